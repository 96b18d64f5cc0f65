"""The planner's load targets (Dynamo's load mode): the workers' load reports heard over the
event plane as the supervisor hears them (a real zmq publisher, file discovery), averaged per
replica over an interval, and the pool sized as Kubernetes' HPA sizes on a utilization."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dynamo_graph.graph.plan import AutoscalePolicy
from dynamo_graph.graph.schema import AutoscaleTarget
from dynamo_graph.graph.targets.local.load_reports import LoadWatch, PoolLoad, discovery_of
from dynamo_graph.graph.targets.local.planner import Measured, PoolPlanner
from dynamo_graph.graph.tls import curve_file, issue_all
from dynamo_graph.router.kv.protocols import LOAD_METRICS_TOPIC, LoadMetrics, encode_event
from dynamo_graph.runtime.events import create_event_publisher
from dynamo_graph.runtime.events.curve import ENV as CURVE_ENV
from dynamo_graph.runtime.names import EndpointName

KV_ONLY = AutoscalePolicy(1, 4, 4, "", None, None, 5.0, 30.0, role="decode", kv_usage=0.8)


def loaded(ready: int, kv: float, waiting: float = 0.0) -> Measured:
    return Measured(ready, 5.0, None, None, 50, load=PoolLoad(kv, waiting, 0.0))


def test_a_pool_over_its_kv_threshold_grows_in_proportion_and_shrinks_after_the_delay() -> None:
    planner = PoolPlanner("decode")
    decision = planner.decide(KV_ONLY, loaded(2, 0.95), 0.0)  # 2 x 0.95 / 0.8 = 2.4
    assert decision.desired == 3 and decision.kv_usage == 0.95, decision
    assert "kv_usage at 1.19 of its threshold" in decision.reason
    assert planner.decide(KV_ONLY, loaded(3, 0.2), 5.0).desired == 3  # 1 would do: wait
    decision = planner.decide(KV_ONLY, loaded(3, 0.2), 36.0)
    assert decision.desired == 1 and "fewer did for 30 s" in decision.reason, decision


def test_a_load_target_beside_a_latency_target_only_adds_replicas() -> None:
    policy = AutoscalePolicy(1, 4, 4, "", 500.0, None, 5.0, 30.0, waiting_requests=2.0)
    planner = PoolPlanner("agg")
    # Latency well within (no capacity yet says nothing) but 6 requests waiting a replica: 3x.
    seen = Measured(1, 5.0, 100.0, None, 50, load=PoolLoad(0.1, 6.0, 0.0))
    assert planner.decide(policy, seen, 0.0).desired == 3
    # Nobody waiting: the load asks for none, and the latency target holds what runs.
    seen = Measured(3, 5.0, 100.0, None, 50, load=PoolLoad(0.1, 0.0, 0.0))
    assert planner.decide(policy, seen, 5.0).desired == 3


def test_the_reports_of_an_interval_are_averaged_per_replica() -> None:
    watch = LoadWatch(EndpointName("dyn", "decode", "generate"), {})
    for blocks, waiting in ((100, 2), (300, 4)):
        watch.hear(LoadMetrics(1, blocks, 400, waiting, 1, prefill_tokens=50))
    watch.hear(LoadMetrics(2, 40, 400, 0, 1))
    watch.hear(LoadMetrics(9, 400, 400, 9, 1))  # not a ready instance of the pool
    load = watch.take({1, 2, 3})  # 3 never reported: idle
    assert load is not None
    assert load.kv_usage == pytest.approx((0.5 + 0.1) / 3) and load.waiting_requests == pytest.approx(1.0)
    assert load.queued_prefill_tokens == pytest.approx(50 / 3)
    again = watch.take({1, 2, 3})  # nothing new: each rank's last report holds
    assert again is not None and again.kv_usage == pytest.approx((0.75 + 0.1) / 3)
    assert watch.take({4}) is None


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_the_supervisor_hears_the_workers_load_reports_on_the_event_plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, curve: bool
) -> None:
    """With TLS on, the reports are CURVE-encrypted with the graph's key: the supervisor, which
    does not hold it in its own environment, subscribes with the key the pool's workers get."""
    env = {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path / "kv")}
    if curve:
        issue_all(tmp_path / "tls", "g", {"decode-0": []})
        env[CURVE_ENV] = curve_file(tmp_path / "tls")
    endpoint = EndpointName("dyn", "decode", "generate")

    async def scenario() -> PoolLoad | None:
        discovery = discovery_of(env)
        await discovery.start()
        for name, value in env.items():  # the worker's environment, while it starts
            monkeypatch.setenv(name, value)
        publisher = await create_event_publisher(
            "zmq", discovery=discovery, namespace="dyn", component="decode", publisher_id=7
        )
        monkeypatch.delenv(CURVE_ENV, raising=False)  # the supervisor's
        watch = LoadWatch(endpoint, {**env, "DYN_EVENT_PLANE": "zmq"})
        await watch.start()
        try:
            for _ in range(50):  # a zmq subscriber joins late: publish until heard (5 s at most)
                await publisher.publish(LOAD_METRICS_TOPIC, encode_event(LoadMetrics(7, 300, 400, 3, 2)))
                await asyncio.sleep(0.1)
                if watch.last:
                    break
            return watch.take({7})
        finally:
            await watch.close()
            await publisher.close()
            await discovery.close()

    load = asyncio.run(scenario())
    assert load is not None and load.kv_usage == 0.75 and load.waiting_requests == 3


def test_a_target_names_every_key_it_accepts_when_none_is_given() -> None:
    with pytest.raises(ValueError, match="`kv_usage`, `waiting_requests`, `queued_prefill_tokens`"):
        AutoscaleTarget.model_validate({})
    with pytest.raises(ValueError, match="kv_usage"):
        AutoscaleTarget.model_validate({"kv_usage": 1.5})
    assert AutoscaleTarget.model_validate({"waiting_requests": 4}).waiting_requests == 4
