"""A tenant's limits and counters: what one key's requests may use, and what they used.

- `max_concurrent`: requests in flight at once; one more is a 429.
- `requests_per_minute`: a token bucket holding up to a minute's requests, refilled continuously
  (a client may burst up to the limit, then gets one request per 60/limit seconds).
- `tokens_per_minute`: a bucket of tokens charged with the request's prompt tokens when it is
  admitted (an engine that tokenizes itself: when it ends) and with its completion tokens when
  it ends. A request is admitted while the bucket is
  not in debt; one that drives it below zero runs to its end, and the next request waits until
  the refill has paid the debt. So the rate over a minute holds without guessing completions
  from `max_tokens`, and a single request is never cut short by the limit.

Each refusal is a 429 with OpenAI's body (`code: rate_limit_exceeded`, `type: requests` or
`tokens`) and `Retry-After`: whole seconds until the refusing limit would admit it. Clocks are
injected (`clock`, monotonic seconds) so the arithmetic is tested without waiting.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dynamo_graph.frontend.errors import HTTPError

log = logging.getLogger(__name__)
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of the keys file (frontend/tenants.py), without its keys."""

    name: str
    models: frozenset[str] | None = None  # None: every model
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    cache_group: str | None = None

    @property
    def salt_group(self) -> str:
        """What its requests' cache salt is made from: tenants of one group share a salt; a
        tenant without one has its own (the prefixes keep a group apart from a tenant's name)."""
        return f"group:{self.cache_group}" if self.cache_group else f"tenant:{self.name}"

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class TokenBucket:
    """Up to `per_minute` units, refilled at `per_minute / 60` a second; `charge` may overdraw."""

    __slots__ = ("capacity", "clock", "level", "rate", "stamp")

    def __init__(self, per_minute: int, clock: Clock) -> None:
        self.clock = clock
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.stamp = clock()

    def resize(self, per_minute: int) -> None:
        """A reloaded limit: the level is kept, within the new capacity."""
        self._refill()
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)

    def _refill(self) -> float:
        now = self.clock()
        elapsed = now - self.stamp
        if elapsed > 0:
            self.level = min(self.capacity, self.level + elapsed * self.rate)
            self.stamp = now
        return self.level

    def wait_s(self, need: float) -> float:
        """Seconds until the bucket holds `need` units (0: now)."""
        missing = need - self._refill()
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, units: float = 1.0) -> float:
        """Take `units` if they are there (0.0), else the seconds until they would be."""
        wait = self.wait_s(units)
        if wait == 0.0:
            self.level -= units
        return wait

    def charge(self, units: float) -> None:
        self._refill()
        self.level -= units


def rate_limited(tenant: str, limit: str, value: int, wait_s: float) -> HTTPError:
    """OpenAI's 429: `type` is what ran out (requests or tokens), `Retry-After` in whole seconds."""
    retry = max(1, math.ceil(wait_s))
    kind = "tokens" if limit == "tokens_per_minute" else "requests"
    what = {
        "requests_per_minute": f"requests per minute (RPM): limit {value}",
        "tokens_per_minute": f"tokens per minute (TPM): limit {value}",
        "max_concurrent": f"concurrent requests: limit {value}",
    }[limit]
    return HTTPError(
        429,
        f"Rate limit reached for tenant {tenant} on {what}. Please try again in {retry}s.",
        code="rate_limit_exceeded",
        error_type=kind,
        headers=[(b"retry-after", str(retry).encode())],
    )


class TenantState:
    """A tenant's limits in force and its counters; kept across reloads of the keys file."""

    def __init__(self, tenant: Tenant, clock: Clock) -> None:
        self.clock = clock
        self.tenant = tenant
        self.inflight = 0
        self.removed = False  # gone from the keys file (its counters stay on /metrics)
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.finished: dict[str, int] = {}  # status -> requests
        self.refused: dict[str, int] = {}  # reason -> requests
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.update(tenant)

    def update(self, tenant: Tenant) -> None:
        """The tenant as the keys file now says; buckets keep their levels."""
        self.tenant = tenant
        self.removed = False
        self.requests = self._bucket(self.requests, tenant.requests_per_minute)
        self.tokens = self._bucket(self.tokens, tenant.tokens_per_minute)

    def _bucket(self, bucket: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        if per_minute is None:
            return None
        if bucket is None:
            return TokenBucket(per_minute, self.clock)
        bucket.resize(per_minute)
        return bucket

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        log.debug("tenant %s: a request refused (%s)", self.tenant.name, reason)

    def admit(self) -> TenantRequest:
        """Take a slot and a request; raises the 429 of the first limit in the way."""
        tenant = self.tenant
        cap = tenant.max_concurrent
        if cap is not None and self.inflight >= cap:
            self.refuse("max_concurrent")
            raise rate_limited(tenant.name, "max_concurrent", cap, 1.0)
        tokens = self.tokens
        if tokens is not None:
            wait = tokens.wait_s(0.0)  # admitted while not in debt
            if wait:
                self.refuse("tokens_per_minute")
                raise rate_limited(tenant.name, "tokens_per_minute", tenant.tokens_per_minute or 0, wait)
        requests = self.requests
        if requests is not None:
            wait = requests.take()
            if wait:
                self.refuse("requests_per_minute")
                raise rate_limited(tenant.name, "requests_per_minute", tenant.requests_per_minute or 0, wait)
        self.inflight += 1
        return TenantRequest(self)

    def charge_prompt(self, tokens: int) -> None:
        self.prompt_tokens += tokens
        if self.tokens is not None:
            self.tokens.charge(tokens)

    def release(self, status: str, completion_tokens: int) -> None:
        """An admitted request ended with `status` (success, error, cancelled)."""
        self.inflight -= 1
        self.finished[status] = self.finished.get(status, 0) + 1
        self.completion_tokens += completion_tokens
        if self.tokens is not None:
            self.tokens.charge(completion_tokens)


class TenantRequest:
    """One admitted request of a tenant: charged its prompt once (`prompt`), however often it
    is accepted; `release` (once) charges its completion, and whatever more of the prompt its
    end counted (an engine that tokenizes itself reports the prompt only then), and frees its
    slot."""

    __slots__ = ("charged", "completion_tokens", "prompt_tokens", "state", "status")

    def __init__(self, state: TenantState) -> None:
        self.state = state
        self.status = "error"  # until the request's lifecycle says otherwise
        self.charged: int | None = None  # prompt tokens charged at admission
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def prompt(self, tokens: int) -> None:
        if self.charged is None:
            self.charged = tokens
            self.state.charge_prompt(tokens)

    def ended(self, status: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.status = status
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def release(self) -> None:
        more = self.prompt_tokens - (self.charged or 0)
        if more > 0:
            self.state.charge_prompt(more)
        self.state.release(self.status, self.completion_tokens)


def collect_tenants(states: Iterable[TenantState]) -> Iterator[Metric]:
    """Per-tenant families for /metrics, labelled `tenant`."""
    requests = CounterMetricFamily(
        "dynamo_frontend_tenant_requests",
        "Requests a tenant's keys got admitted, by how they ended",
        labels=["tenant", "status"],
    )
    tokens = CounterMetricFamily(
        "dynamo_frontend_tenant_tokens", "Tokens a tenant's requests used", labels=["tenant", "kind"]
    )
    errors = CounterMetricFamily(
        "dynamo_frontend_tenant_errors",
        "A tenant's requests refused (model_not_found, a limit) or failed (request_failed)",
        labels=["tenant", "reason"],
    )
    inflight = GaugeMetricFamily(
        "dynamo_frontend_tenant_inflight_requests", "A tenant's requests in flight", labels=["tenant"]
    )
    for state in states:
        name = state.tenant.name
        for status, n in sorted(state.finished.items()):
            requests.add_metric([name, status], n)
        tokens.add_metric([name, "prompt"], state.prompt_tokens)
        tokens.add_metric([name, "completion"], state.completion_tokens)
        failed = state.finished.get("error", 0)
        for reason, n in sorted({**state.refused, "request_failed": failed}.items()):
            errors.add_metric([name, reason], n)
        inflight.add_metric([name], state.inflight)
    yield from (requests, tokens, errors, inflight)
