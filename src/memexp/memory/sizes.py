"""Memory sizes as people write them: 12GiB, 16GB, 500 MiB."""

from __future__ import annotations

import re

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, key: str) -> int:
    """'12GiB', '16GB', '500 MiB', or a number of bytes; anything else (a size under one byte,
    such as 0 or 0.5b, included) is an error naming `key`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = (match.group(2) or "b").lower() if match else None
    if unit not in UNITS or float(match.group(1)) * UNITS[unit] < 1:
        raise ValueError(f"{key}={text}: expected a positive size such as 12GiB, 16GB or 500MiB "
                         f"(at least 1 byte; units: {', '.join(sorted(UNITS, key=UNITS.get))})")
    return int(float(match.group(1)) * UNITS[unit])
