"""What one frontend lets a request use: body size, concurrency, time.

- `body_limit`: bytes of request body; more is a 413 (DYN_HTTP_BODY_LIMIT_MB, --http-body-limit-mb).
- `max_concurrent`: generation requests in flight at once; one more is answered 503 with
  `Retry-After` at once, never queued (--max-concurrent-requests; 0 = unlimited).
- `request_timeout_s`: wall time of one generation request from its admission; on expiry its
  generation is cancelled and the client gets a 504 (before the first byte) or an error event
  (mid-stream) (--request-timeout-s; None = none).
- `reject_unknown_fields`: a request field its API does not declare is a 400 naming it
  (--http-unknown-fields reject, the default) or ignored (ignore).
- `model_wait_s`: how long a request for a served model with no routable worker waits for one
  before its 503 with `Retry-After` (--model-wait-s; the model watcher keeps such a model that
  long too).

Rejections are counted by reason and exported with the frontend's metrics.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_graph.frontend.settings import LimitSettings

DEFAULT_BODY_LIMIT = 32 * 1024 * 1024
DEFAULT_MAX_CONCURRENT = 1024
DEFAULT_MODEL_WAIT_S = LimitSettings().model_wait_s
RETRY_AFTER_S = 1


def body_limit_from_env() -> int:
    """`DYN_HTTP_BODY_LIMIT_MB`, as Dynamo names it; 32 MiB by default."""
    raw = os.environ.get("DYN_HTTP_BODY_LIMIT_MB")
    try:
        return mb_to_bytes(float(raw)) if raw else DEFAULT_BODY_LIMIT
    except ValueError:
        return DEFAULT_BODY_LIMIT


def mb_to_bytes(mb: float) -> int:
    return int(mb * 1024 * 1024)


@dataclass(frozen=True)
class FrontendLimits:
    body_limit: int = DEFAULT_BODY_LIMIT
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # 0: unlimited
    request_timeout_s: float | None = None
    model_wait_s: float = DEFAULT_MODEL_WAIT_S
    reject_unknown_fields: bool = True

    @classmethod
    def from_settings(
        cls,
        *,
        body_limit_mb: float | None = None,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        request_timeout_s: float | None = None,
        model_wait_s: float = DEFAULT_MODEL_WAIT_S,
        unknown_fields: str = "reject",
    ) -> FrontendLimits:
        """The flag wins over DYN_HTTP_BODY_LIMIT_MB; a timeout of 0 means none."""
        body_limit = body_limit_from_env() if body_limit_mb is None else mb_to_bytes(body_limit_mb)
        return cls(
            body_limit=body_limit,
            max_concurrent=max_concurrent,
            request_timeout_s=request_timeout_s or None,
            model_wait_s=model_wait_s,
            reject_unknown_fields=unknown_fields == "reject",
        )


class Admission(Collector):
    """Counts the generation requests in flight against the cap, and what was turned away."""

    def __init__(self, limits: FrontendLimits) -> None:
        self.limits = limits
        self.inflight = 0
        # reason -> count: overloaded, unauthorized, body_too_large, timeout
        self.rejected: dict[str, int] = {}

    def try_acquire(self) -> bool:
        cap = self.limits.max_concurrent
        if cap and self.inflight >= cap:
            self.count("overloaded")
            return False
        self.inflight += 1
        return True

    def release(self) -> None:
        self.inflight -= 1

    def count(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def collect(self) -> Iterator[Metric]:
        rejected = CounterMetricFamily(
            "dynamo_frontend_rejected_requests",
            "Requests refused or cut short by the frontend's limits and auth",
            labels=["reason"],
        )
        for reason, n in sorted(self.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield GaugeMetricFamily(
            "dynamo_frontend_admitted_requests",
            "Generation requests holding one of the frontend's concurrency slots",
            value=self.inflight,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_max_concurrent_requests",
            "The frontend's concurrency cap (0: unlimited)",
            value=self.limits.max_concurrent,
        )
