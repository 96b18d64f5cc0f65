"""The event plane (KV events, load metrics): pick a backend by name or from `DYN_EVENT_PLANE`.

`zmq` is the default, as in Dynamo 1.x: nothing to run (publishers announce their sockets in
discovery). A zmq publisher binds where the process's request plane listens, `DYN_TCP_HOST`
(127.0.0.1 when unset), and announces `DYN_TCP_ADVERTISE_HOST` when set: a graph on many hosts
sets both to each host's routable address, so a kv router on another host subscribes to it.
`nats` needs a server but no routable worker addresses; `inproc` is for a graph in one process.
Backend modules are imported on first use so that choosing one never imports another's client.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dynamo_graph.runtime.discovery.base import Discovery
from dynamo_graph.runtime.events.base import Event, EventPublisher, EventSubscriber
from dynamo_graph.runtime.events.common import ALL_INTERFACES
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
    "zmq_addresses",
]

EVENT_PLANE_ENV = "DYN_EVENT_PLANE"
EVENT_PLANES = ("inproc", "zmq", "nats")
DEFAULT_EVENT_PLANE = "zmq"
NATS_URL_ENV = "NATS_SERVER"  # the variable Dynamo reads
BIND_HOST_ENV = "DYN_TCP_HOST"  # the request plane's: one address per process for both planes
ADVERTISE_HOST_ENV = "DYN_TCP_ADVERTISE_HOST"
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


def zmq_addresses(host: str | None = None, advertise_host: str | None = None) -> tuple[str, str | None]:
    """Where a zmq publisher binds and what it announces: as given, else the request plane's
    `DYN_TCP_HOST` / `DYN_TCP_ADVERTISE_HOST`, else loopback. zmq binds one interface, never all:
    a process whose request plane listens on all of them binds its advertised address."""
    host = host or os.environ.get(BIND_HOST_ENV) or "127.0.0.1"
    advertise_host = advertise_host or os.environ.get(ADVERTISE_HOST_ENV) or None
    if host in ALL_INTERFACES:
        if advertise_host is None:
            raise ValueError(
                f"{BIND_HOST_ENV}={host!r} (all interfaces): the zmq event plane binds one; set "
                f"{ADVERTISE_HOST_ENV} to this host's routable address"
            )
        host = advertise_host
    return host, advertise_host


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
    zmq_host: str | None = None,
    zmq_advertise_host: str | None = None,
) -> EventPublisher:
    """A publisher on channel namespace/component. `zmq_host` is the one interface zmq binds and
    `zmq_advertise_host` the address it announces (defaults: `zmq_addresses`)."""
    kind = event_plane_kind(kind)
    if kind == "inproc":
        return (bus or inproc_bus(namespace, component)).publisher(publisher_id)
    if kind == "zmq":
        from dynamo_graph.runtime.events.zmq import ZmqEventPublisher

        host, advertise_host = zmq_addresses(zmq_host, zmq_advertise_host)
        return await ZmqEventPublisher.create(
            _need_discovery(discovery),
            namespace,
            component,
            publisher_id,
            host=host,
            advertise_host=advertise_host,
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
    env: Mapping[str, str] | None = None,
) -> EventSubscriber:
    """A subscriber to every publisher of channel namespace/component, for topics starting with
    any of `topics` ("" for all); credentials and keys from `env` (default: this process's: the
    supervisor subscribes with those of the graph's processes)."""
    kind = event_plane_kind(kind)
    if kind == "inproc":
        return (bus or inproc_bus(namespace, component)).subscriber(topics)
    if kind == "zmq":
        from dynamo_graph.runtime.events.zmq import ZmqEventSubscriber

        known = _need_discovery(discovery)
        return await ZmqEventSubscriber.create(known, namespace, component, topics, env=env)
    from dynamo_graph.runtime.events.nats import NatsEventSubscriber

    return await NatsEventSubscriber.create(_nats_url(nats_url), namespace, component, topics, env=env)
