"""Instance health checks (runtime/health.py): the state machine on a fake clock, the checker with
fake probes, how the client routes and reports, and the worker-side in-flight cap with the
client's answer to `overloaded`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from dynamo_graph.backend.errors import EngineError, EngineOverloaded, InvalidArgument
from dynamo_graph.backend.handlers import InflightCap, tokens_handler
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.process.run_config import parse_run_config
from dynamo_graph.runtime.client import Client, InstanceOverloaded, NoInstances
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.health import (
    HealthChecker,
    HealthSettings,
    HealthTable,
    default_payload,
)
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.runtime import DistributedRuntime, InstanceRecord
from dynamo_graph.runtime.transport.base import CannotConnect

NAME = EndpointName("ns", "comp", "ep")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(instance_id: int) -> InstanceRecord:
    return InstanceRecord(
        namespace="ns",
        component="comp",
        endpoint="ep",
        instance_id=instance_id,
        transport={"fake": str(instance_id)},
        subject="ns.comp.ep",
    )


def _client(clock: FakeClock | None = None, ids: tuple[int, ...] = (1, 2, 3)) -> Client:
    client = Client(DistributedRuntime(discovery=None, static=True), NAME)
    if clock is not None:
        client.health = HealthTable(clock=clock, wall=clock, on_change=client._changed.set, name="t")
    for instance_id in ids:
        client.add_static(_record(instance_id))
    return client


# ---- the state machine ------------------------------------------------------------------------


def test_an_idle_instance_becomes_due_and_answers_keep_it_from_being_checked() -> None:
    clock = FakeClock()
    table = HealthTable(clock=clock, wall=clock)
    table.add(1)
    table.add(2)
    assert table.due([1, 2], 5.0) == []  # new: idle from now
    clock.now += 4.0
    table.last_response[2] = clock.now  # a response frame from 2: busy, healthy
    clock.now += 1.5
    assert table.due([1, 2], 5.0) == [1]
    table.probe_started(1)
    assert table.due([1, 2], 5.0) == []  # never two checks of one instance
    table.probe_done(1, True, 0.01)
    assert table.due([1, 2], 5.0) == []
    assert table.entries[1].checks == 1 and table.entries[1].last_check_ok


def test_a_failed_check_makes_an_instance_unhealthy_until_one_passes() -> None:
    clock = FakeClock()
    changes: list[int] = []
    table = HealthTable(clock=clock, wall=clock, on_change=lambda: changes.append(1))
    table.add(1)
    clock.now += 5
    table.probe_started(1)
    clock.now += 3
    table.probe_done(1, False, 3.0, "no answer within 3s")
    entry = table.entries[1]
    assert table.is_unhealthy(1) and entry.reason == "no answer within 3s" and entry.since == clock.now
    assert changes == [1]
    # Checked again `interval` after the last check started, not after the last answer.
    assert table.due([1], 5.0) == []
    clock.now += 2.0
    assert table.due([1], 5.0) == [1]
    table.probe_started(1)
    table.probe_done(1, False, 3.0, "still nothing")
    assert table.is_unhealthy(1) and entry.failed_checks == 2 and entry.reason == "still nothing"
    assert changes == [1]  # no new transition
    clock.now += 5
    table.probe_started(1)
    table.probe_done(1, True, 0.02)
    assert not table.is_unhealthy(1) and entry.reason is None and changes == [1, 1]
    table.probe_aborted(1)
    table.remove(1)
    table.probe_done(1, False, 1.0)  # a check that ends after its instance left: ignored
    assert 1 not in table.entries and not table.is_unhealthy(1)


def test_unhealthy_instances_leave_routing_and_are_listed_with_their_reason() -> None:
    clock = FakeClock()
    client = _client(clock)
    client.health.probe_started(2)
    client.health.probe_done(2, False, 3.0, "no answer within 3s")
    assert client.instance_ids() == [1, 3]
    assert {client.pick() for _ in range(6)} == {1, 3}
    assert client.checkable_ids() == [1, 2, 3]  # still checked, so it can come back
    client.report_instance_down(3)
    client.refused[9] = (clock.now, "model card checksum x differs from the model's y")
    report = client.health_report()
    assert [i["instance_id"] for i in report["instances"]] == ["1"]
    assert report["instances"][0]["state"] == "healthy"
    states = {i["instance_id"]: (i["state"], i.get("reason")) for i in report["unavailable"]}
    assert states == {
        "2": ("unhealthy", "no answer within 3s"),
        "3": ("cooling_off", "unreachable"),
        "9": ("refused", "model card checksum x differs from the model's y"),
    }
    unhealthy = report["unavailable"][0]
    assert unhealthy["since"] == clock.now and unhealthy["last_check"]["ok"] is False
    assert unhealthy["last_check"]["latency_ms"] == 3000.0
    assert client.checkable_ids() == [1, 2]  # cooling off: not checked
    client.health.probe_started(2)
    client.health.probe_done(2, True, 0.01)
    assert client.instance_ids() == [1, 2]


def test_registry_health_reports_per_model_status() -> None:
    class P:
        def __init__(self, name: str) -> None:
            self.name = name

    registry = ModelRegistry()
    client = _client(FakeClock(), ids=(1,))
    registry.add(P("remote"), instances=client.health_report)  # type: ignore[arg-type]
    registry.add(P("local"))  # type: ignore[arg-type]
    registry.add(P("old"), instances=lambda: [])  # type: ignore[arg-type]
    health = registry.health()
    assert health["local"] == {"status": "healthy", "instances": "in-process"}
    assert health["remote"]["status"] == "healthy" and health["remote"]["unavailable"] == []
    assert health["old"] == {"status": "unhealthy", "instances": []}
    client.health.probe_started(1)
    client.health.probe_done(1, False, 1.0, "boom")
    health = registry.health()
    assert health["remote"]["status"] == "unhealthy" and health["remote"]["instances"] == []


# ---- the checker --------------------------------------------------------------------------------


class FakeProbe:
    """Answers per instance: "ok", "hang", "overloaded", "invalid", "error", "refused"."""

    def __init__(self, answers: dict[int, str]) -> None:
        self.answers = answers
        self.calls: list[tuple[int, Any]] = []
        self.running = 0
        self.most = 0

    async def __call__(self, instance_id: int, payload: Any, timeout_s: float) -> None:
        self.calls.append((instance_id, payload))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            answer = self.answers.get(instance_id, "ok")
            if answer == "hang":
                async with asyncio.timeout(timeout_s):
                    await asyncio.Event().wait()
            elif answer == "slow":
                await asyncio.sleep(timeout_s / 2)
            elif answer == "overloaded":
                raise EngineOverloaded("at its limit")
            elif answer == "invalid":
                raise InvalidArgument("bad payload")
            elif answer == "error":
                raise EngineError("CUDA error")
            elif answer == "refused":
                raise CannotConnect("connection refused")
        finally:
            self.running -= 1


async def _run_checks(checker: HealthChecker) -> None:
    tasks = checker.tick()
    await asyncio.gather(*tasks)


async def test_checker_sends_each_instances_payload_and_judges_the_answers() -> None:
    clock = FakeClock()
    client = _client(clock, ids=(1, 2, 3, 4, 5, 6))
    probe = FakeProbe({2: "hang", 3: "overloaded", 4: "invalid", 5: "error", 6: "refused"})
    settings = HealthSettings(interval_s=5.0, timeout_s=0.05)
    checker = HealthChecker(client, settings, {"default": True}, probe=probe)
    checker.payloads[1] = {"mine": 1}
    assert checker.tick() == []  # nobody idle yet
    clock.now += 5
    await _run_checks(checker)
    assert dict(probe.calls)[1] == {"mine": 1} and dict(probe.calls)[2] == {"default": True}
    assert client.instance_ids() == [1, 3, 4]  # overloaded / invalid: answered, so alive
    reasons = {i: client.health.entries[i].reason for i in (2, 5, 6)}
    assert reasons == {
        2: "no answer within 0.05s",
        5: "internal: CUDA error",
        6: "cannot_connect: connection refused",
    }
    # Recovery: the next round (interval later) finds them answering again.
    probe.answers = {}
    clock.now += 5
    await _run_checks(checker)
    assert client.instance_ids() == [1, 2, 3, 4, 5, 6]


async def test_checker_caps_concurrency_and_never_checks_one_instance_twice() -> None:
    clock = FakeClock()
    client = _client(clock, ids=tuple(range(1, 11)))
    probe = FakeProbe(dict.fromkeys(range(1, 11), "slow"))
    checker = HealthChecker(
        client, HealthSettings(interval_s=1.0, timeout_s=0.1, max_concurrent=3), probe=probe
    )
    clock.now += 2
    first = checker.tick()
    assert len(first) == 3 and checker.tick() == []  # the cap is reached
    clock.now += 2
    assert checker.tick() == []  # still running: none of the three again, no one else yet
    await asyncio.gather(*first)
    second = checker.tick()
    assert len(second) == 3
    await asyncio.gather(*second)
    assert probe.most == 3
    checked = [i for i, _ in probe.calls]
    assert len(checked) == len(set(checked)) == 6
    assert not client.health.unhealthy


async def test_checker_loop_runs_and_closes() -> None:
    client = _client(ids=(1,))
    probe = FakeProbe({1: "hang"})
    checker = HealthChecker(client, HealthSettings(interval_s=0.05, timeout_s=0.05), probe=probe)
    checker.start()
    for _ in range(100):
        if client.health.unhealthy:
            break
        await asyncio.sleep(0.02)
    assert client.instance_ids() == []
    await checker.close()
    probe.answers = {}
    await asyncio.sleep(0.15)
    assert client.instance_ids() == []  # closed: no more checks
    disabled = HealthChecker(client, HealthSettings(interval_s=0), probe=probe)
    disabled.start()
    assert disabled._task is None


def test_settings_from_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HEALTH_CHECK_INTERVAL_S", raising=False)
    monkeypatch.delenv("DYN_HEALTH_CHECK_TIMEOUT_S", raising=False)
    assert HealthSettings.from_env() == HealthSettings(5.0, 3.0)
    monkeypatch.setenv("DYN_HEALTH_CHECK_INTERVAL_S", "0")
    monkeypatch.setenv("DYN_HEALTH_CHECK_TIMEOUT_S", "1.5")
    settings = HealthSettings.from_env()
    assert not settings.enabled and settings.timeout_s == 1.5
    monkeypatch.setenv("DYN_HEALTH_CHECK_INTERVAL_S", "soon")
    with pytest.raises(ValueError, match="DYN_HEALTH_CHECK_INTERVAL_S"):
        HealthSettings.from_env()
    with pytest.raises(RunConfigError, match="--health-check-interval-s"):
        parse_run_config(["--health-check-interval-s", "-1"])
    with pytest.raises(RunConfigError, match="--health-check-timeout-s"):
        parse_run_config(["--health-check-timeout-s", "0"])
    with pytest.raises(RunConfigError, match="--max-inflight"):
        parse_run_config(["--max-inflight", "-1"])


def test_default_payloads_are_valid_requests() -> None:
    tokens = default_payload("m", "tokens", 7)
    request = msgspec.convert(tokens, PreprocessedRequest)
    assert request.token_ids == [7] and request.stop_conditions.max_tokens == 1
    assert default_payload("m", "tokens")["token_ids"] == [1]
    assert default_payload("m", "text")["max_tokens"] == 1


# ---- worker cap and the client's answer to `overloaded` -----------------------------------------


class SlowEngine:
    publishes_kv_events = False

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def generate(self, request: Any, context: Context) -> AsyncIterator[LLMEngineOutput]:
        await self.release.wait()
        yield LLMEngineOutput(token_ids=[5], finish_reason="length")

    async def abort(self, context: Context) -> None:
        pass


async def test_worker_cap_answers_overloaded_before_any_output() -> None:
    engine = SlowEngine()
    cap = InflightCap(2)
    handler = tokens_handler(engine, cap=cap)  # type: ignore[arg-type]
    request = PreprocessedRequest(model="m", token_ids=[1])

    async def one() -> list[LLMEngineOutput]:
        return [o async for o in handler(request, Context())]

    running = [asyncio.create_task(one()) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert cap.inflight == 2
    with pytest.raises(EngineOverloaded, match="limit of 2"):
        await one()
    engine.release.set()
    assert [len(r) for r in await asyncio.gather(*running)] == [1, 1]
    assert cap.inflight == 0 and cap.refused == 1
    unlimited = InflightCap(0)
    for _ in range(5000):
        unlimited.enter()
    assert unlimited.inflight == 5000


class FakePlane:
    """A request plane whose instances answer per a script: "ok" streams two items, "busy"
    answers overloaded at once, "late-busy" after one item, "down" cannot be reached."""

    def __init__(self, script: dict[str, str]) -> None:
        self.script = script
        self.asked: list[str] = []

    async def stream(
        self, transport: dict, subject: str, payload: bytes, headers: dict, ctx: Context, timeout_s: Any
    ) -> AsyncIterator[bytes]:
        which = transport["fake"]
        self.asked.append(which)
        answer = self.script.get(which, "ok")
        if answer == "down":
            raise CannotConnect("refused")
        if answer == "busy":
            raise EngineOverloaded("at its limit")
        yield msgspec.msgpack.encode({"i": which})
        if answer == "late-busy":
            raise EngineOverloaded("at its limit")
        yield msgspec.msgpack.encode({"i": which, "end": True})


def _planed(script: dict[str, str]) -> tuple[Client, FakePlane]:
    client = _client()
    plane = FakePlane(script)
    client.runtime.client_for = lambda transport: plane  # type: ignore[method-assign,assignment]
    return client, plane


async def _collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


async def test_client_sends_an_overloaded_request_elsewhere_without_cool_off() -> None:
    client, plane = _planed({"1": "busy"})
    got = await _collect(client.generate({"x": 1}))
    assert got[0]["i"] in ("2", "3") and plane.asked[0] == "1" and len(plane.asked) == 2
    assert client.instance_ids() == [1, 2, 3]  # only busy: still routable
    # Every instance busy: the overload reaches the caller (503), not "no instances".
    client, plane = _planed({"1": "busy", "2": "busy", "3": "busy"})
    with pytest.raises(EngineOverloaded):
        await _collect(client.generate({"x": 1}))
    assert sorted(plane.asked) == ["1", "2", "3"]
    # Asked by id (the KV router's way): a CannotConnect, which the KV router routes around.
    client, plane = _planed({"2": "busy"})
    with pytest.raises(InstanceOverloaded) as caught:
        await _collect(client.generate({"x": 1}, instance_id=2))
    assert isinstance(caught.value, CannotConnect) and caught.value.instance_id == 2  # type: ignore[attr-defined]
    assert client.instance_ids() == [1, 2, 3]
    # After the first item it is the stream's error, not a reason to go elsewhere.
    client, plane = _planed({"1": "late-busy"})
    with pytest.raises(EngineOverloaded):
        await _collect(client.generate({"x": 1}, instance_id=1))


async def test_client_probe_is_not_counted_and_answers_count_as_health() -> None:
    clock = FakeClock()
    client, _plane = _planed({"3": "busy"})
    await client.probe(1, {"p": 1}, 1.0)
    assert client.sent == {}
    with pytest.raises(EngineOverloaded):
        await client.probe(3, {"p": 1}, 1.0)
    with pytest.raises(NoInstances):
        await client.probe(42, {"p": 1}, 1.0)
    client.health = HealthTable(clock=clock, wall=clock)
    for i in (1, 2, 3):
        client.health.add(i)
    clock.now += 10
    assert client.health.due([1, 2, 3], 5.0) == [1, 2, 3]
    await _collect(client.generate({"x": 1}, instance_id=2))
    assert client.sent == {2: 1}
    assert 2 not in client.health.due([1, 2, 3], 5.0)  # it answered: no check needed


async def test_client_probe_times_out_and_cancels() -> None:
    client = _client()
    cancelled = asyncio.Event()

    class Hanging:
        async def stream(self, *args: Any) -> AsyncIterator[bytes]:
            try:
                await asyncio.Event().wait()
                yield b""
            finally:
                cancelled.set()

    client.runtime.client_for = lambda transport: Hanging()  # type: ignore[method-assign,assignment]
    with pytest.raises(TimeoutError):
        await client.probe(1, {"p": 1}, 0.05)
    assert cancelled.is_set()
