"""Third-party noise that a memexp user cannot act on, dropped while the call that makes it runs."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# torchao's import logs warnings its users cannot act on: its CUDA kernel libraries do not load
# into a CPU build of torch, and without CUDA there is no Triton (AdamW8bit needs neither); and
# torch deprecates register_constant() on Enum classes, which torchao calls. Exactly those
# records are dropped.
TORCHAO_NOISE = {
    "torchao": re.compile(r"Failed to load \S*/torchao/_C[^/]*\.so: "),
    "torchao.kernel.intmm": re.compile(r"Warning: Detected no triton, "),
    "torch.utils._pytree": re.compile(r"%s is an Enum subclass and is now natively supported "),
}


class DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(str(record.msg))


@contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Import torchao without its TORCHAO_NOISE (the filters live only during the import)."""
    filters = {name: DropMatching(pattern) for name, pattern in TORCHAO_NOISE.items()}
    for name, keep in filters.items():
        logging.getLogger(name).addFilter(keep)
    try:
        yield
    finally:
        for name, keep in filters.items():
            logging.getLogger(name).removeFilter(keep)


@contextmanager
def c_stderr_dropped() -> Iterator[None]:
    """Drop what C++ code writes to the process's stderr meanwhile: kineto prints a
    `USDT: ... profiler_start` (and `profiler_stop`) line whenever torch's profiler starts or
    stops, whatever KINETO_LOG_LEVEL says. Only for calls that print nothing a user needs."""
    sys.stderr.flush()
    kept = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
        os.close(null)
