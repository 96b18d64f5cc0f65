"""Calling an endpoint's instances: discovery keeps the instance list, a picker spreads requests.

An instance that fails to connect or breaks a stream is dropped from routing at once (before
its lease expires) and comes back only when discovery announces it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.backend.errors import EngineError, EngineShutdown
from dynamo_graph.router.push import InstancePicker
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.names import EndpointName, instance_id_from_key
from dynamo_graph.runtime.transport.base import CannotConnect, StreamBroken

if TYPE_CHECKING:
    from dynamo_graph.runtime.runtime import DistributedRuntime, InstanceRecord

log = logging.getLogger(__name__)
DOWN_COOLOFF_S = 5.0
_encode = msgspec.msgpack.encode
_decode_any = msgspec.msgpack.Decoder()


@functools.cache
def _decoder(response_type: type | None) -> Callable[[bytes], Any]:
    """One msgpack decoder per response type, built once (it is on every request's path)."""
    return msgspec.msgpack.Decoder(response_type).decode if response_type else _decode_any.decode


class NoInstances(EngineError):
    code = "no_instances"
    http_status = 503


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
        # Instances that failed us, left out of routing until this (monotonic) time.
        self._down_until: dict[int, float] = {}
        self._ordered: list[int] = []
        self._changed = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        discovery = self.runtime.discovery
        if discovery is None:
            raise EngineError(
                f"{self.name}: a static runtime has no discovery; use a static endpoint address"
            )
        self._watch_task = asyncio.create_task(self._watch(), name=f"watch {self.name}")

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

    def _set(self, instance_id: int, record: InstanceRecord) -> None:
        self.instances[instance_id] = record
        self._down_until.pop(instance_id, None)  # (re-)registered: routable again at once
        self._ordered = sorted(self.instances)
        self._changed.set()

    def _drop(self, instance_id: int) -> None:
        self._down_until.pop(instance_id, None)
        if self.instances.pop(instance_id, None) is not None:
            self._ordered = sorted(self.instances)
            self._changed.set()

    def _routable(self, instance_id: int) -> bool:
        allowed = self.allowed
        if allowed is not None and instance_id not in allowed:
            return False
        until = self._down_until.get(instance_id)
        if until is None:
            return True
        if time.monotonic() < until:
            return False
        del self._down_until[instance_id]  # cooled off: try it again
        return True

    def instance_ids(self) -> list[int]:
        """The instances requests may go to now."""
        return [i for i in self._ordered if self._routable(i)]

    def report(self) -> list[dict[str, Any]]:
        """The routable instances, where they are, and how many requests each was sent."""
        return [
            {
                "instance_id": f"{i:x}",
                "transport": self.instances[i].transport,
                "requests": self.sent.get(i, 0),
            }
            for i in self.instance_ids()
        ]

    def report_instance_down(self, instance_id: int) -> None:
        """Leave an instance that failed us out of routing for DOWN_COOLOFF_S. A dead worker is
        gone from discovery by then (its lease expires); a live one that had a passing fault
        (or a static one, which discovery cannot vouch for) gets traffic again."""
        if instance_id in self.instances:
            log.warning(
                "%s: instance %x is unreachable, leaving it out of routing for %.0fs",
                self.name,
                instance_id,
                DOWN_COOLOFF_S,
            )
            self._down_until[instance_id] = time.monotonic() + DOWN_COOLOFF_S
            self._changed.set()

    async def wait_for_instances(self, timeout_s: float | None = None) -> list[int]:
        async def wait() -> list[int]:
            while not self.instance_ids():
                self._changed.clear()
                await self._changed.wait()
            return self.instance_ids()

        return await asyncio.wait_for(wait(), timeout_s)

    def pick(self, exclude: set[int] | None = None, picker: InstancePicker | None = None) -> int:
        candidates = [i for i in self.instance_ids() if not exclude or i not in exclude]
        if not candidates:
            raise NoInstances(f"no instances of {self.name} are available")
        return (picker or self.picker).pick(candidates)

    async def generate(
        self,
        request: Any,
        *,
        instance_id: int | None = None,
        context: Context | None = None,
        response_type: type | None = None,
        timeout_s: float | None = None,
        exclude: set[int] | None = None,
    ) -> AsyncIterator[Any]:
        """Send `request` to one instance (the picker's choice among those not in `exclude`, or
        `instance_id`) and stream its responses. An instance that cannot be reached leaves
        routing; if the picker chose it, the request goes to another instance (nothing was
        generated yet, so that is always safe). A stream that breaks midway raises StreamBroken:
        resuming it is request migration's job. Errors raised from an instance's stream carry
        its id as `err.instance_id`; one that broke, or whose engine is shutting down, leaves
        routing for DOWN_COOLOFF_S (or until discovery announces it again)."""
        decode = _decoder(response_type)
        payload = _encode(request)
        ctx = context or Context()
        tried: set[int] = set(exclude) if exclude else set()
        while True:
            target = self.pick(exclude=tried) if instance_id is None else instance_id
            record = self.instances.get(target)
            if record is None:
                raise NoInstances(f"instance {target:x} of {self.name} is not known")
            self.sent[target] = self.sent.get(target, 0) + 1
            stream = self.runtime.client_for(record.transport).stream(
                record.transport, record.subject, payload, {}, ctx, timeout_s
            )
            try:
                async for item in stream:
                    yield decode(item)
                return
            except CannotConnect as err:
                self.report_instance_down(target)
                if instance_id is not None:
                    err.instance_id = target  # type: ignore[attr-defined]
                    raise
                tried.add(target)
            except EngineError as err:
                if isinstance(err, (StreamBroken, EngineShutdown)):
                    self.report_instance_down(target)
                err.instance_id = target  # type: ignore[attr-defined]
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
