"""Health checks of a client's instances: a canary from the caller, as Dynamo's health checks do.

Dynamo (docs "Health Checks": DYN_HEALTH_CHECK_ENABLED, DYN_CANARY_WAIT_TIME default 10 s,
DYN_HEALTH_CHECK_REQUEST_TIMEOUT default 3 s) sends a canary request to an endpoint that has
been idle for the wait time, using the payload the worker registered, and marks it unhealthy
when the canary times out. Here the frontend does it for every instance of every model it
serves, so one wedged worker (alive, registered, lease kept, but no longer answering) leaves
routing without waiting for a user request to hang on it:

- An instance is due for a check when nothing came back from it (no response frame of any
  request, no passing check) for `interval_s`. Requests that stream answers are proof of
  health: busy instances are not checked. An unhealthy instance is checked again every
  `interval_s` and is healthy again after one passing check.
- The check is the worker's own health-check payload (its model card's
  `user_data.health_check_payload`; for a card without one, a 1-token generate from the model's
  BOS token, or a 1-token chat for text models), sent straight to that instance (no router, no
  request count, no frontend metrics) with a deadline of `timeout_s`.
- Passing: the stream ends, or the worker answers at once that it is overloaded or that the
  payload is invalid (it answered: it is alive). Failing: no end within the deadline (the
  request is cancelled), a broken stream, a failed connection, any other engine error. One
  failure takes the instance out of routing (the client's routable set, which every router mode
  picks from), one pass puts it back.
- At most `max_concurrent` checks run at once per client; never two on one instance.

`interval_s` 0 turns the checks off. Settings: `--health-check-interval-s` /
`--health-check-timeout-s` on the frontend (env DYN_HEALTH_CHECK_INTERVAL_S /
DYN_HEALTH_CHECK_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_graph.runtime.env import env_float
from dynamo_graph.runtime.errors import InvalidArgument, Overloaded, RequestError

if TYPE_CHECKING:
    from dynamo_graph.runtime.client import Client

log = logging.getLogger(__name__)

HEALTHY = "healthy"
UNHEALTHY = "unhealthy"
COOLING_OFF = "cooling_off"  # a connection failed: out of routing for a while (client.py)
REFUSED = "refused"  # its model card does not match the model's (frontend/model_watcher.py)

DEFAULT_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 3.0
MAX_CONCURRENT_CHECKS = 8
INTERVAL_ENV = "DYN_HEALTH_CHECK_INTERVAL_S"
TIMEOUT_ENV = "DYN_HEALTH_CHECK_TIMEOUT_S"
# Answers that prove the worker is alive although the check did not generate.
RESPONSIVE_ERRORS: tuple[type[RequestError], ...] = (Overloaded, InvalidArgument)


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = DEFAULT_INTERVAL_S  # 0: no health checks
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrent: int = MAX_CONCURRENT_CHECKS

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    @classmethod
    def from_env(cls) -> HealthSettings:
        interval = env_float(INTERVAL_ENV, DEFAULT_INTERVAL_S)
        timeout = env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
        return cls(interval_s=interval, timeout_s=timeout or DEFAULT_TIMEOUT_S)


@dataclass(slots=True)
class InstanceHealth:
    since: float  # wall clock: when the instance entered its current state
    unhealthy: bool = False
    reason: str | None = None
    probing: bool = False
    last_probe_start: float = -math.inf  # monotonic
    last_check: float | None = None  # wall clock, when the last check ended
    last_check_latency_s: float | None = None
    last_check_ok: bool | None = None
    checks: int = 0
    failed_checks: int = 0


class HealthTable:
    """The health state of one client's instances. `last_response` is written on the client's hot
    path (every response frame); the rest changes only when checks start and end."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_change: Callable[[], None] | None = None,
        name: str = "",
    ) -> None:
        self.clock = clock
        self.wall = wall
        self.on_change = on_change
        self.name = name
        self.last_response: dict[int, float] = {}  # monotonic: last frame or passing check
        self.entries: dict[int, InstanceHealth] = {}
        self.unhealthy: set[int] = set()

    def add(self, instance_id: int) -> InstanceHealth:
        entry = self.entries.get(instance_id)
        if entry is None:
            entry = self.entries[instance_id] = InstanceHealth(since=self.wall())
            self.last_response.setdefault(instance_id, self.clock())  # new: idle from now
        return entry

    def remove(self, instance_id: int) -> None:
        self.entries.pop(instance_id, None)
        self.last_response.pop(instance_id, None)
        self.unhealthy.discard(instance_id)

    def is_unhealthy(self, instance_id: int) -> bool:
        return instance_id in self.unhealthy

    def due(self, instance_ids: list[int], interval_s: float) -> list[int]:
        """The instances to check now, those idle longest first: not being checked, and silent
        (healthy) or unchecked (unhealthy) for `interval_s`."""
        now = self.clock()
        due: list[tuple[float, int]] = []
        for instance_id in instance_ids:
            entry = self.add(instance_id)
            if entry.probing:
                continue
            if entry.unhealthy:
                last = entry.last_probe_start
            else:
                last = max(self.last_response.get(instance_id, -math.inf), entry.last_probe_start)
            if now - last >= interval_s:
                due.append((last, instance_id))
        return [instance_id for _, instance_id in sorted(due)]

    def probe_started(self, instance_id: int) -> None:
        entry = self.add(instance_id)
        entry.probing = True
        entry.last_probe_start = self.clock()

    def probe_aborted(self, instance_id: int) -> None:
        entry = self.entries.get(instance_id)
        if entry is not None:
            entry.probing = False

    def probe_done(self, instance_id: int, ok: bool, latency_s: float, reason: str | None = None) -> None:
        """Record a check's outcome; a failure makes the instance unhealthy, a pass healthy."""
        entry = self.entries.get(instance_id)
        if entry is None:  # it left discovery while being checked
            return
        entry.probing = False
        entry.checks += 1
        entry.last_check = self.wall()
        entry.last_check_latency_s = latency_s
        entry.last_check_ok = ok
        if ok:
            self.last_response[instance_id] = self.clock()
            if entry.unhealthy:
                entry.unhealthy, entry.reason, entry.since = False, None, self.wall()
                self.unhealthy.discard(instance_id)
                log.info(
                    "%s: instance %x passed its health check (%.0f ms): back in routing",
                    self.name,
                    instance_id,
                    latency_s * 1000,
                )
                self._changed()
            return
        entry.failed_checks += 1
        entry.reason = reason or "health check failed"
        if not entry.unhealthy:
            entry.unhealthy, entry.since = True, self.wall()
            self.unhealthy.add(instance_id)
            log.warning(
                "%s: instance %x failed its health check (%s): left out of routing until it passes",
                self.name,
                instance_id,
                entry.reason,
            )
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


Probe = Callable[[int, Any, float], Awaitable[None]]
"""(instance_id, payload, timeout_s): returns when the check passed, raises otherwise."""


class HealthChecker:
    """Checks one client's instances in the background (see the module doc). `payloads`: the
    health-check request per instance (from its model card); `default_payload` for the others."""

    def __init__(
        self,
        client: Client,
        settings: HealthSettings,
        default_payload: Any = None,
        *,
        probe: Probe | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.default_payload = default_payload
        self.payloads: dict[int, Any] = {}
        self._probe: Probe = probe or client.probe
        self._running: dict[int, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def tick_s(self) -> float:
        return min(max(self.settings.interval_s / 4, 0.05), 0.5)

    def start(self) -> None:
        if self.settings.enabled and self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"health checks {self.client.name}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.tick()
            except Exception:
                log.exception("%s: health check round failed", self.client.name)

    def tick(self) -> list[asyncio.Task[None]]:
        """Start the checks that are due (within the concurrency cap); returns their tasks."""
        table = self.client.health
        free = self.settings.max_concurrent - len(self._running)
        started: list[asyncio.Task[None]] = []
        if free <= 0:
            return started
        for instance_id in table.due(self.client.checkable_ids(), self.settings.interval_s)[:free]:
            table.probe_started(instance_id)
            task = asyncio.create_task(self._check(instance_id), name=f"health check {instance_id:x}")
            self._running[instance_id] = task
            task.add_done_callback(lambda _, i=instance_id: self._running.pop(i, None))
            started.append(task)
        return started

    async def _check(self, instance_id: int) -> None:
        table = self.client.health
        payload = self.payloads.get(instance_id, self.default_payload)
        timeout = self.settings.timeout_s
        start = table.clock()
        ok, reason = True, None
        try:
            await self._probe(instance_id, payload, timeout)
        except TimeoutError:
            ok, reason = False, f"no answer within {timeout:g}s"
        except RESPONSIVE_ERRORS as err:
            log.debug("%s: instance %x answered its health check with %s", self.client.name, instance_id, err)
        except RequestError as err:
            ok, reason = False, f"{err.code}: {err.message}"
        except asyncio.CancelledError:
            table.probe_aborted(instance_id)  # stopped (the instance left, or shutdown), not failed
            raise
        except Exception as err:
            ok, reason = False, f"{type(err).__name__}: {err}"
        table.probe_done(instance_id, ok, table.clock() - start, reason)

    def forget(self, instance_id: int) -> None:
        self.payloads.pop(instance_id, None)
        task = self._running.pop(instance_id, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._running.values()) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def default_payload(model: str, model_input: str, bos_token_id: int | None = None) -> dict[str, Any]:
    """A check for a worker whose card has none: the tiniest generate, in the worker's wire form."""
    if model_input == "tokens":
        return {
            "model": model,
            "token_ids": [1 if bos_token_id is None else bos_token_id],
            "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0},
        }
    return {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
