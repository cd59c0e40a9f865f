"""Sizes and counts as people write them: `"512M"`, `"16G"`, `"1.3e9"`, `"130M"`."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """`"512M"` -> 536870912 bytes. K/M/G/T are powers of 1024; an int is bytes already."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"{text} is negative")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size like 512M or 2G")
    scale = 1024 ** " KMGT".index((m.group(2) or " ").upper())
    return int(float(m.group(1)) * scale)


def parse_count(text: str | int) -> int:
    """`"1.3e9"`, `"130M"`, `"20000000"` -> a count (K/M/G/T are powers of 1000 here)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value: float = text
    else:
        t = str(text).strip().upper()
        scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}.get(t[-1:], 1)
        try:
            value = float(t[:-1] if scale != 1 else t) * scale
        except ValueError:
            raise ValueError(f"{text!r} is not a count like 1.3e9 or 130M") from None
    if value < 1:
        raise ValueError(f"{text!r} must be at least 1")
    return int(value)
