"""Sizes as flags give them (``8GiB``, ``512MB``, plain bytes): the standard library only, so that
`wcache serve`'s front process parses its flags without torch (engine/api_server/core_client.py)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_HELP = "bytes, or a number with a unit: KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB"


def parse_bytes(text: str) -> int:
    """``"8GiB"`` -> 8589934592; plain integers are bytes. ValueError (with the accepted forms) otherwise."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: give {SIZE_HELP}")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return n
