"""memexp's training entry point: `python train.py [overrides]` (see README)."""

import sys

try:
    from hydra_plugins.memexp_launcher import server
    from memexp import permanent_imports
except ModuleNotFoundError as error:  # a python without memexp's packages: not the venv's
    sys.exit(f"memexp: {sys.executable} cannot import {error.name}: train.py runs in memexp's "
             "virtual environment. Create it once with `make install`, then `source "
             ".venv/bin/activate` (or run .venv/bin/python train.py ...)")

if __name__ == "__main__":
    # A sweep's preloaded server starts before the imports below, to import beside them.
    server.start_early(sys.argv[1:])
    with permanent_imports():
        from memexp.app import main
    main()
