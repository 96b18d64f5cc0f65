"""Calling an endpoint's instances: discovery keeps the instance list, a picker spreads requests.

An instance that fails to connect or breaks a stream is dropped from routing at once (before
its lease expires) for DOWN_COOLOFF_S, or until discovery announces it again. One that fails its
health check (runtime/health.py) stays out of routing until it passes one. One that answers
`overloaded` before its first response (a worker at its `--max-inflight`) is skipped for that
request only: the request goes to another instance, as after a failed connection, without a
cool-off and without counting as a migration.

A component's traffic split (runtime/traffic.py: a canary rollout's share for the new
revision's instances) narrows each request's candidates (`routing_ids`), and every instance's
answers are counted (`AnswerStats`, in `/health`), so the rollout can compare the two groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import Overloaded, RequestError, ShuttingDown
from dynamo_graph.runtime.health import COOLING_OFF, HEALTHY, REFUSED, UNHEALTHY, HealthTable
from dynamo_graph.runtime.names import EndpointName, instance_id_from_key
from dynamo_graph.runtime.pickers import InstancePicker
from dynamo_graph.runtime.traffic import AnswerStats, TrafficSplit, TrafficSplits
from dynamo_graph.runtime.transport.base import CannotConnect, StreamBroken

if TYPE_CHECKING:
    from dynamo_graph.runtime.runtime import DistributedRuntime, InstanceRecord

log = logging.getLogger(__name__)
DOWN_COOLOFF_S = 5.0
_encode = msgspec.msgpack.encode
_decode_any = msgspec.msgpack.Decoder()


PickHook = Callable[[list[int], int], None]
"""Called as (candidates, chosen) on each choice a client's picker makes (the decision log)."""


@functools.cache
def _decoder(response_type: type | None) -> Callable[[bytes], Any]:
    """One msgpack decoder per response type, built once (it is on every request's path)."""
    return msgspec.msgpack.Decoder(response_type).decode if response_type else _decode_any.decode


class NoInstances(RequestError):
    """No instance serves the endpoint (none registered, or all gone)."""

    code = "no_instances"
    http_status = 503


class InstanceOverloaded(CannotConnect):
    """An instance asked by id answered `overloaded` before any response: a CannotConnect, so
    the routers that pick instances themselves (the KV router) try another, as they do after a
    failed connection; nothing was generated."""

    code = "overloaded"
    http_status = 503


def _when(wall: float | None) -> float | None:
    return None if wall is None else round(wall, 3)


class Client:
    def __init__(
        self, runtime: DistributedRuntime, name: EndpointName, *, router_mode: str = "round-robin"
    ) -> None:
        from dynamo_graph.runtime.runtime import InstanceRecord

        self.runtime = runtime
        self.name = name
        self.picker = InstancePicker(router_mode)
        self._random = InstancePicker("random")
        self._round_robin = InstancePicker("round-robin")
        self._record_decoder = msgspec.json.Decoder(InstanceRecord)
        self.instances: dict[int, InstanceRecord] = {}
        # When set, only these instances are routed to (e.g. those whose model card was accepted).
        self.allowed: set[int] | None = None
        # Requests sent to each instance (for /health and for checking how load spreads).
        self.sent: dict[int, int] = {}
        self.answers: dict[int, AnswerStats] = {}  # how each instance answered them
        self._splits: TrafficSplits | None = None  # the components' splits, once started
        # Instances that failed us, left out of routing until this (monotonic) time.
        self._down_until: dict[int, float] = {}
        self._down_since: dict[int, tuple[float, str]] = {}  # (wall clock, why), for /health
        # Instances whose model card was refused (frontend/model_watcher.py): instance -> why.
        self.refused: dict[int, tuple[float, str]] = {}
        self._ordered: list[int] = []
        self._changed = asyncio.Event()
        # Health-check state (runtime/health.py); unhealthy instances are left out of routing.
        self.health = HealthTable(on_change=self._changed.set, name=str(name))
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        discovery = self.runtime.discovery
        if discovery is None:
            raise RequestError(
                f"{self.name}: a static runtime has no discovery; use a static endpoint address"
            )
        self._watch_task = asyncio.create_task(self._watch(), name=f"watch {self.name}")
        self._splits = self.runtime.traffic()

    def add_static(self, record: InstanceRecord) -> None:
        """Route to a known address with no discovery (static mode)."""
        self._set(record.instance_id, record)

    async def _watch(self) -> None:
        assert self.runtime.discovery is not None
        async for event in self.runtime.discovery.watch_prefix(self.name.instances_prefix()):
            instance_id = instance_id_from_key(event.key)
            if event.kind == "put" and event.value is not None:
                try:
                    self._set(instance_id, self._record_decoder.decode(event.value))
                except msgspec.DecodeError as err:
                    log.warning("ignoring malformed instance record %s: %s", event.key, err)
            else:
                self._drop(instance_id)

    @property
    def split(self) -> TrafficSplit | None:
        """The component's traffic split, while one is set."""
        splits = self._splits
        return None if splits is None else splits.get(self.name.namespace, self.name.component)

    def _set(self, instance_id: int, record: InstanceRecord) -> None:
        self.instances[instance_id] = record
        self._down_until.pop(instance_id, None)  # (re-)registered: routable again at once
        self._down_since.pop(instance_id, None)
        self.health.add(instance_id)  # health is kept: re-registering does not prove it
        self._ordered = sorted(self.instances)
        self._changed.set()

    def _drop(self, instance_id: int) -> None:
        self.answers.pop(instance_id, None)
        self._down_until.pop(instance_id, None)
        self._down_since.pop(instance_id, None)
        self.health.remove(instance_id)
        if self.instances.pop(instance_id, None) is not None:
            self._ordered = sorted(self.instances)
            self._changed.set()

    def _routable(self, instance_id: int) -> bool:
        allowed = self.allowed
        if allowed is not None and instance_id not in allowed:
            return False
        if instance_id in self.health.unhealthy:
            return False
        return not self._cooling_off(instance_id)

    def _cooling_off(self, instance_id: int) -> bool:
        until = self._down_until.get(instance_id)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._down_until[instance_id]  # cooled off: try it again
        self._down_since.pop(instance_id, None)
        return False

    def instance_ids(self) -> list[int]:
        """The instances requests may go to now."""
        return [i for i in self._ordered if self._routable(i)]

    def routing_ids(self) -> list[int]:
        """The candidates of one request: `instance_ids`, narrowed to one side of the traffic
        split (drawn per call) while a split is set."""
        ids = self.instance_ids()
        split = self.split
        if split is None or not ids:
            return ids
        labels = {i: r.labels for i in ids if (r := self.instances.get(i)) is not None}
        return split.choose(ids, labels, random.random())

    def checkable_ids(self) -> list[int]:
        """The instances to health-check: known, accepted, not cooling off after a failure."""
        allowed = self.allowed
        return [i for i in self._ordered if (allowed is None or i in allowed) and not self._cooling_off(i)]

    def _describe(self, instance_id: int, state: str, since: float | None, reason: str | None) -> dict:
        record = self.instances.get(instance_id)
        entry = self.health.entries.get(instance_id)
        info: dict[str, Any] = {
            "instance_id": f"{instance_id:x}",
            "transport": None if record is None else record.transport,
            "requests": self.sent.get(instance_id, 0),
            "state": state,
            "since": _when(since),
        }
        if record is not None and record.labels:
            info["labels"] = record.labels
        if (answers := self.answers.get(instance_id)) is not None:
            info.update(answers.report())
        if reason is not None:
            info["reason"] = reason
        if entry is not None and entry.checks:
            latency = entry.last_check_latency_s
            info["last_check"] = {
                "at": _when(entry.last_check),
                "ok": entry.last_check_ok,
                "latency_ms": None if latency is None else round(latency * 1000, 1),
                "checks": entry.checks,
                "failed": entry.failed_checks,
            }
        return info

    def report(self) -> list[dict[str, Any]]:
        """The routable instances: where they are, how many requests each was sent, their state
        (`healthy`) and their last health check."""
        entries = self.health.entries
        return [
            self._describe(i, HEALTHY, entries[i].since if i in entries else None, None)
            for i in self.instance_ids()
        ]

    def unavailable(self) -> list[dict[str, Any]]:
        """Known instances left out of routing, with why: `unhealthy` (a failed health check),
        `cooling_off` (a failed connection or broken stream) or `refused` (model card mismatch)."""
        out = []
        for i in self._ordered:
            if i in self.refused or (self.allowed is not None and i not in self.allowed):
                continue  # refused ones are listed below; others may serve another model
            entry = self.health.entries.get(i)
            if entry is not None and entry.unhealthy:
                out.append(self._describe(i, UNHEALTHY, entry.since, entry.reason))
            elif self._cooling_off(i):
                since, why = self._down_since.get(i, (None, "unreachable"))
                out.append(self._describe(i, COOLING_OFF, since, why))
        for i, (since, why) in sorted(self.refused.items()):
            out.append(self._describe(i, REFUSED, since, why))
        return out

    def health_report(self) -> dict[str, Any]:
        """For /health: the routable `instances` and the `unavailable` ones."""
        return {"instances": self.report(), "unavailable": self.unavailable()}

    def report_instance_down(self, instance_id: int, reason: str = "unreachable") -> None:
        """Leave an instance that failed us out of routing for DOWN_COOLOFF_S. A dead worker is
        gone from discovery by then (its lease expires); a live one that had a passing fault
        (or a static one, which discovery cannot vouch for) gets traffic again."""
        if instance_id in self.instances:
            log.warning(
                "%s: instance %x is %s, leaving it out of routing for %.0fs",
                self.name,
                instance_id,
                reason,
                DOWN_COOLOFF_S,
            )
            self._down_until[instance_id] = time.monotonic() + DOWN_COOLOFF_S
            self._down_since[instance_id] = (time.time(), reason)
            self._changed.set()

    async def wait_for_change(self) -> None:
        """Until the instances or their health change next."""
        self._changed.clear()
        await self._changed.wait()

    async def wait_for_instances(self, timeout_s: float | None = None) -> list[int]:
        async def wait() -> list[int]:
            while not self.instance_ids():
                await self.wait_for_change()
            return self.instance_ids()

        return await asyncio.wait_for(wait(), timeout_s)

    def candidates(self, exclude: set[int] | None = None) -> list[int]:
        """One request's candidates (`routing_ids`) but those in `exclude`; when its side of the
        traffic split has none left, any other routable instance (serving beats the split)."""
        ids = [i for i in self.routing_ids() if not exclude or i not in exclude]
        if not ids and self.split is not None:
            ids = [i for i in self.instance_ids() if not exclude or i not in exclude]
        return ids

    def pick(
        self,
        exclude: set[int] | None = None,
        picker: InstancePicker | None = None,
        on_pick: PickHook | None = None,
    ) -> int:
        candidates = self.candidates(exclude)
        if not candidates:
            raise NoInstances(f"no instances of {self.name} are available")
        target = (picker or self.picker).pick(candidates)
        if on_pick is not None:
            on_pick(candidates, target)
        return target

    async def generate(
        self,
        request: Any,
        *,
        instance_id: int | None = None,
        context: Context | None = None,
        response_type: type | None = None,
        timeout_s: float | None = None,
        exclude: set[int] | None = None,
        on_pick: PickHook | None = None,
        units_sent: int = 0,
        units_of: Callable[[Any], int] | None = None,
    ) -> AsyncIterator[Any]:
        """Send `request` to one instance (the picker's choice among those not in `exclude`, or
        `instance_id`) and stream its responses; `on_pick` hears each choice the picker makes.
        An instance that cannot be reached leaves routing; if the picker chose it, the request
        goes to another instance (nothing was generated yet, so that is always safe). So does
        one that answers `overloaded` before any response (no cool-off: it is only busy); asked
        by id, that raises
        InstanceOverloaded (a CannotConnect). When every instance was overloaded the last
        Overloaded is raised (503). A stream the picker's instance broke before any response
        goes to another instance, once (the instance was leaving as the request reached it); one
        that breaks midway, or asked by id, raises StreamBroken: resuming it is request
        migration's job. Errors raised from an instance's stream carry
        its id as `err.instance_id`; one that broke, or whose engine is shutting down, leaves
        routing for DOWN_COOLOFF_S (or until discovery announces it again). `units_sent` and
        `units_of(response)` are the work the request and each response carry, summed per
        instance in its AnswerStats (an autoscaler sizes pools by them)."""
        decode = _decoder(response_type)
        payload = _encode(request)
        ctx = context or Context()
        tried: set[int] = set(exclude) if exclude else set()
        seen = self.health.last_response
        now = time.monotonic
        overloaded: Overloaded | None = None
        broken: StreamBroken | None = None  # an instance's stream broke before it answered (retried once)
        called_as = f"call {self.name}"
        while True:
            if instance_id is None:
                try:
                    target = self.pick(exclude=tried, on_pick=on_pick)
                except NoInstances:
                    if overloaded is not None:
                        raise overloaded from None
                    if broken is not None:
                        raise broken from None
                    raise
            else:
                target = instance_id
            record = self.instances.get(target)
            if record is None:
                raise NoInstances(f"instance {target:x} of {self.name} is not known")
            self.sent[target] = self.sent.get(target, 0) + 1
            answers = self.answers.get(target)
            if answers is None:
                answers = self.answers[target] = AnswerStats()
            answers.requests += 1
            answers.request_units += units_sent
            sent_at = last_at = now()
            call = tracing.span(called_as, ctx, {"instance.id": f"{target:x}"}, kind="client")
            stream = self.runtime.client_for(record.transport).stream(
                record.transport, record.subject, payload, call.carrier, ctx, timeout_s
            )
            started = False
            try:
                async for item in stream:
                    seen[target] = at = now()  # an answer: proof of health (runtime/health.py)
                    if started:
                        answers.next_response(at - last_at)
                    else:
                        started = True
                        answers.first_response(at - sent_at)
                    last_at = at
                    response = decode(item)
                    if units_of is not None:
                        answers.response_units += units_of(response)
                    yield response
                seen[target] = now()
                return
            except CannotConnect as err:
                call.fail(err)
                answers.errors += 1
                self.report_instance_down(target)
                if instance_id is not None:
                    err.instance_id = target  # type: ignore[attr-defined]
                    raise
                tried.add(target)
            except Overloaded as err:
                call.fail(err)
                seen[target] = now()  # it answered at once: alive, only busy
                if started:
                    err.instance_id = target  # type: ignore[attr-defined]
                    raise
                log.debug("%s: instance %x is overloaded; trying another", self.name, target)
                if instance_id is not None:
                    busy = InstanceOverloaded(err.message)
                    busy.instance_id = target  # type: ignore[attr-defined]
                    raise busy from None
                overloaded = err
                tried.add(target)
            except StreamBroken as err:
                call.fail(err)
                answers.errors += 1
                self.report_instance_down(target)
                err.instance_id = target  # type: ignore[attr-defined]
                if started or instance_id is not None or broken is not None:
                    raise
                # Nothing came back: a connection the instance closed as the request reached it
                # (it was leaving). Another instance, once: a request that itself kills workers
                # takes down two at most.
                log.debug(
                    "%s: instance %x dropped a request it never answered; trying another", self.name, target
                )
                broken = err
                tried.add(target)
            except RequestError as err:
                call.fail(err)
                if err.http_status >= 500:  # the instance's fault, not the request's
                    answers.errors += 1
                if isinstance(err, (StreamBroken, ShuttingDown)):
                    self.report_instance_down(target)
                err.instance_id = target  # type: ignore[attr-defined]
                raise
            finally:
                call.end()
                await stream.aclose()  # type: ignore[attr-defined]

    async def probe(self, instance_id: int, request: Any, timeout_s: float) -> None:
        """A health check: send `request` to one instance and read its stream to the end within
        `timeout_s` (else TimeoutError, and the request is cancelled). Not counted in `sent`,
        never retried, never routed; errors propagate as they came."""
        record = self.instances.get(instance_id)
        if record is None:
            raise NoInstances(f"instance {instance_id:x} of {self.name} is not known")
        ctx = Context(f"health-check-{uuid.uuid4().hex[:16]}")
        stream = self.runtime.client_for(record.transport).stream(
            record.transport, record.subject, _encode(request), {}, ctx, None
        )
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in stream:
                    pass
        except TimeoutError:
            ctx.stop_generating()
            raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    # Dynamo's Python client spells routing choices as methods returning a stream.
    async def random(self, request: Any, context: Context | None = None) -> AsyncIterator[Any]:
        return self.generate(request, instance_id=self.pick(picker=self._random), context=context)

    async def round_robin(self, request: Any, context: Context | None = None) -> AsyncIterator[Any]:
        return self.generate(request, instance_id=self.pick(picker=self._round_robin), context=context)

    async def direct(
        self, request: Any, instance_id: int, context: Context | None = None
    ) -> AsyncIterator[Any]:
        return self.generate(request, instance_id=instance_id, context=context)

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
