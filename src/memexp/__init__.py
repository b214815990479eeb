"""memexp: measure which memory-saving techniques make a model and batch fit, and what they cost."""

__version__ = "0.1.0"
