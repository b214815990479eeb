"""How memexp names an optional extra that the running Python lacks: the interpreter too, since
a CUDA estimate traces in a venv of its own (make cuda-estimator), which may lack what the
user's venv has."""

from __future__ import annotations

import sys


def install_hint(extra: str) -> str:
    """`in <this python>: <this python> -m pip install 'memexp[extra]'`."""
    return f"in {sys.executable}: {sys.executable} -m pip install 'memexp[{extra}]'"
