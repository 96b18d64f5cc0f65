"""Picking an instance for a request without looking at its content: random and round-robin.

KV-aware routing (router/kv) looks at the request's blocks; these two only spread load. Dynamo
calls them its "push router" modes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

MODES = ("random", "round-robin")


class InstancePicker:
    def __init__(self, mode: str = "round-robin", *, seed: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"router mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self._next = 0
        self._rng = random.Random(seed)

    def pick(self, instance_ids: Sequence[int]) -> int:
        """`instance_ids` must be non-empty and in a stable order (round-robin walks it)."""
        if self.mode == "random":
            return self._rng.choice(instance_ids)
        index = self._next % len(instance_ids)
        self._next = index + 1
        return instance_ids[index]
