"""The event plane (KV events, load metrics): pick a backend by name or from `DYN_EVENT_PLANE`.

`zmq` is the default, as in Dynamo 1.x: nothing to run on one host (publishers announce loopback
sockets in discovery). `nats` is for many machines; `inproc` for a graph in one process. Backend
modules are imported on first use so that choosing one never imports another's client.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dynamo_graph.runtime.discovery.base import Discovery
from dynamo_graph.runtime.events.base import Event, EventPublisher, EventSubscriber
from dynamo_graph.runtime.events.inproc import InProcEventBus

__all__ = [
    "DEFAULT_EVENT_PLANE",
    "EVENT_PLANES",
    "EVENT_PLANE_ENV",
    "Event",
    "EventPublisher",
    "EventSubscriber",
    "InProcEventBus",
    "create_event_publisher",
    "create_event_subscriber",
    "event_plane_kind",
    "inproc_bus",
]

EVENT_PLANE_ENV = "DYN_EVENT_PLANE"
EVENT_PLANES = ("inproc", "zmq", "nats")
DEFAULT_EVENT_PLANE = "zmq"
NATS_URL_ENV = "NATS_SERVER"  # the variable Dynamo reads
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

_BUSES: dict[tuple[str, str], InProcEventBus] = {}


def event_plane_kind(kind: str | None = None) -> str:
    """`kind` if given, else `$DYN_EVENT_PLANE`, else zmq; anything else is an error that says
    where the bad value came from."""
    source = "event plane kind"
    if kind is None:
        kind = os.environ.get(EVENT_PLANE_ENV) or DEFAULT_EVENT_PLANE
        source = EVENT_PLANE_ENV
    if kind not in EVENT_PLANES:
        raise ValueError(f"{source}={kind!r}: expected one of {', '.join(EVENT_PLANES)}")
    return kind


def inproc_bus(namespace: str, component: str) -> InProcEventBus:
    """This process's bus for one channel, so that channels stay apart as they do on zmq/NATS."""
    return _BUSES.setdefault((namespace, component), InProcEventBus())


def _nats_url(nats_url: str | None) -> str:
    return nats_url or os.environ.get(NATS_URL_ENV) or DEFAULT_NATS_URL


def _need_discovery(discovery: Discovery | None) -> Discovery:
    if discovery is None:
        raise ValueError("the zmq event plane needs discovery (publishers announce their sockets there)")
    return discovery


async def create_event_publisher(
    kind: str | None = None,
    *,
    discovery: Discovery | None = None,
    namespace: str,
    component: str,
    publisher_id: int,
    nats_url: str | None = None,
    bus: InProcEventBus | None = None,
    zmq_host: str = "127.0.0.1",
    zmq_advertise_host: str | None = None,
) -> EventPublisher:
    """A publisher on channel namespace/component. `zmq_host` is the one interface zmq binds
    (set it and/or `zmq_advertise_host` to a routable address for many machines)."""
    kind = event_plane_kind(kind)
    if kind == "inproc":
        return (bus or inproc_bus(namespace, component)).publisher(publisher_id)
    if kind == "zmq":
        from dynamo_graph.runtime.events.zmq import ZmqEventPublisher

        return await ZmqEventPublisher.create(
            _need_discovery(discovery),
            namespace,
            component,
            publisher_id,
            host=zmq_host,
            advertise_host=zmq_advertise_host,
        )
    from dynamo_graph.runtime.events.nats import NatsEventPublisher

    return await NatsEventPublisher.create(_nats_url(nats_url), namespace, component, publisher_id)


async def create_event_subscriber(
    kind: str | None = None,
    *,
    discovery: Discovery | None = None,
    namespace: str,
    component: str,
    topics: Sequence[str],
    nats_url: str | None = None,
    bus: InProcEventBus | None = None,
) -> EventSubscriber:
    """A subscriber to every publisher of channel namespace/component, for topics starting with
    any of `topics` ("" for all)."""
    kind = event_plane_kind(kind)
    if kind == "inproc":
        return (bus or inproc_bus(namespace, component)).subscriber(topics)
    if kind == "zmq":
        from dynamo_graph.runtime.events.zmq import ZmqEventSubscriber

        return await ZmqEventSubscriber.create(_need_discovery(discovery), namespace, component, topics)
    from dynamo_graph.runtime.events.nats import NatsEventSubscriber

    return await NatsEventSubscriber.create(_nats_url(nats_url), namespace, component, topics)
