"""Which instances a Client routes to: round-robin over the routable ones, failed instances left
out for a cool-off, then tried again (discovery drops the ones that are really dead)."""

from __future__ import annotations

import time

import pytest

from dynamo_graph.runtime import client as client_module
from dynamo_graph.runtime.client import Client, NoInstances
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.runtime import DistributedRuntime, InstanceRecord

NAME = EndpointName("ns", "comp", "ep")


def _client() -> Client:
    client = Client(DistributedRuntime(discovery=None, static=True), NAME)
    for instance_id in (1, 2, 3):
        client.add_static(
            InstanceRecord(
                namespace="ns",
                component="comp",
                endpoint="ep",
                instance_id=instance_id,
                transport={"tcp": f"127.0.0.1:{9000 + instance_id}"},
                subject="ns.comp.ep",
            )
        )
    return client


def test_round_robin_skips_a_failed_instance_until_it_cools_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "DOWN_COOLOFF_S", 0.2)
    client = _client()
    assert [client.pick() for _ in range(3)] == [1, 2, 3]
    client.report_instance_down(2)
    assert client.instance_ids() == [1, 3]
    assert {client.pick() for _ in range(4)} == {1, 3}
    time.sleep(0.25)
    assert client.instance_ids() == [1, 2, 3]


def test_reregistration_makes_an_instance_routable_at_once() -> None:
    client = _client()
    client.report_instance_down(3)
    assert 3 not in client.instance_ids()
    client.add_static(client.instances[3])  # what a discovery put does
    assert 3 in client.instance_ids()


def test_allowed_set_and_no_instances() -> None:
    client = _client()
    client.allowed = {2}
    assert client.instance_ids() == [2]
    client.report_instance_down(2)
    with pytest.raises(NoInstances):
        client.pick()
