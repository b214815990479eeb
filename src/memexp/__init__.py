"""memexp: measure which memory-saving techniques make a model and batch fit, and what they cost."""

import os
import sys

__version__ = "0.1.0"


def import_from_working_directory() -> None:
    """Your own modules (model=custom model._target_=mypkg.Net, loss=custom, ...) import from
    the directory train.py or memexp runs in, as they would under `python -m`: `python
    train.py` puts only train.py's folder on sys.path, and the `memexp` command none."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(1, cwd)  # after the script's folder, as `python -m` puts it first
