"""Files that are either complete or absent: a killed process never leaves half of one."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """Write `path` through a temporary file in its folder, flushed to disk, then renamed over
    it (`os.replace` is atomic). On any error, or a kill, the old `path` is untouched.

    The file gets the permissions any new file gets (0666 less the umask), as `open` gives: a
    record or a checkpoint on a shared filesystem is readable by the team (tempfile's mkstemp
    would make it 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
