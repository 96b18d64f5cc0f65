"""Numbers from the environment (DYN_* settings), with the variable named when one is wrong."""

from __future__ import annotations

import math
import os


def env_float(name: str, default: float, *, allow_zero: bool = True) -> float:
    """`name`'s value as a finite number >= 0 (> 0 unless `allow_zero`), or `default` when unset;
    a ValueError naming the variable otherwise."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {raw!r}") from None
    if math.isinf(value) or not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'above 0'}, not {raw!r}")
    return value
