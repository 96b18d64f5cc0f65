"""Routing decisions you can read (`--router-decision-log`): why each request went where.

One JSON line per decision a frontend's router makes, in every mode. A request is routed once
in an aggregated graph and twice in a disaggregated one (its prefill on the `prefill` pool, its
continuation on the `decode` pool), and once more for each migration or worker found unreachable.
A line (docs/observability.md):

    {"ts": 1764380000.123, "request_id": "…", "model": "m", "pool": "agg", "mode": "kv",
     "cost": "predictive", "isl": 812, "chosen": "6a1f…", "dp_rank": 0,
     "candidates": [{"worker": "6a1f…", "dp_rank": 0, "overlap_blocks": 48, "new_tokens": 44,
                     "queued_tokens": 0, "decode_blocks": 0, "cost": 0.0312}, …],
     "queue_wait_ms": 0.0, "migrations": 0, "excluded": []}

Workers are instance ids in hex, as /health and `dyngraph status` name them. Round-robin and
random candidates carry only `worker`. The lines go through `JsonLines`: the router hands over a
dict and a background thread writes it, rotating by size.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dynamo_graph.runtime.jsonl import JsonLines

if TYPE_CHECKING:
    from dynamo_graph.llm.protocol import PreprocessedRequest
    from dynamo_graph.router.config import RouterConfig
    from dynamo_graph.runtime.client import PickHook
    from dynamo_graph.runtime.context import Context

MIB = 1 << 20


class DecisionLog:
    """One frontend process's decision log; `pool` gives each model's pools their writer."""

    def __init__(self, config: RouterConfig) -> None:
        assert config.decision_log is not None
        self.config = config
        self.lines = JsonLines(
            config.decision_log,
            max_bytes=int(config.decision_log_max_mb * MIB),
            keep=config.decision_log_keep,
        )

    @classmethod
    def open(cls, config: RouterConfig | None) -> DecisionLog | None:
        """The log `config` asks for, or None."""
        return cls(config) if config is not None and config.decision_log else None

    def pool(self, model: str, prefill: bool, kv: bool) -> PoolDecisions:
        """The writer of one model's prefill pool, or of its decode (or aggregated) pool;
        `kv`: routed by the KV router (else by the client's picker, the frontend's mode)."""
        mode = "kv" if kv else ("round-robin" if self.config.mode == "kv" else self.config.mode)
        return PoolDecisions(self.lines, model, prefill, mode, self.config.cost if kv else None)

    def close(self) -> None:
        self.lines.close()


class PoolDecisions:
    __slots__ = ("cost", "lines", "mode", "model", "prefill")

    def __init__(self, lines: JsonLines, model: str, prefill: bool, mode: str, cost: str | None) -> None:
        self.lines = lines
        self.model = model
        self.prefill = prefill
        self.mode = mode
        self.cost = cost

    def record(
        self,
        context: Context,
        request: PreprocessedRequest,
        candidates: list[dict[str, Any]],
        chosen: int,
        dp_rank: int | None = None,
        *,
        queue_wait_s: float | None = None,
        excluded: Iterable[int] | None = None,
    ) -> None:
        """One decision: the request went to `chosen` among `candidates`."""
        # A continuation of a remote prefill carries where its KV waits.
        pool = "prefill" if self.prefill else "agg" if request.kv_transfer_params is None else "decode"
        self.lines.write(
            {
                "ts": round(time.time(), 3),
                "request_id": context.id,
                "model": self.model,
                "pool": pool,
                "mode": self.mode,
                "cost": self.cost,
                "isl": len(request.token_ids),
                "chosen": f"{chosen:x}",
                "dp_rank": dp_rank,
                "candidates": candidates,
                "queue_wait_ms": None if queue_wait_s is None else round(queue_wait_s * 1000, 3),
                "migrations": context.migrations,
                "excluded": [f"{i:x}" for i in excluded or ()],
            }
        )

    def picked(self, context: Context, request: PreprocessedRequest, excluded: set[int] | None) -> PickHook:
        """The client picker's hook (round-robin, random) that records its choices."""

        def hook(candidates: list[int], chosen: int) -> None:
            self.record(
                context, request, [{"worker": f"{i:x}"} for i in candidates], chosen, excluded=excluded
            )

        return hook
