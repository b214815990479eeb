"""What memexp takes from its dependencies' private APIs, one module each, so that an upgrade
that moves one of them fails in one place, with a message naming it, and in a test
(tests/test_adapters.py) rather than in a sweep. pyproject.toml pins the versions each was
checked on."""
