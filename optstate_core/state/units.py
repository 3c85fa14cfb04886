"""Parsing of byte sizes given as numbers or strings ("64MB", "2GiB", "0.5GB")."""
from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_bytes(value, arg: str, allow_zero: bool = False) -> int:
    """A positive byte count from an int or a string such as ``"64MB"``; errors name ``arg``.
    ``allow_zero``: ``0`` (or ``"0"``) is accepted too, for options where it means "off"."""
    if allow_zero and not isinstance(value, bool) and (value == 0 or str(value).strip() == "0"):
        return 0
    if isinstance(value, bool):
        raise ValueError(f"{arg} must be a byte count such as 67108864 or '64MB', got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value == int(value)):
        raise ValueError(f"{arg} must be a whole number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{arg} must be a byte count such as 67108864 or '64MB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{arg} must be a byte count such as 67108864 or '64MB', got {value!r}")
    if n <= 0:
        raise ValueError(f"{arg} must be positive, got {value!r}")
    return n
