"""`{port:NAME}` placeholders -> free 127.0.0.1 ports, stable for the life of a supervisor.

A name keeps its port across restarts of its process and across `up`s that change the graph,
so a process that did not change keeps its exact command line.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import msgspec

from dynamo_graph.graph.plan import LOCAL, Plan, ProcessSpec

_PLACEHOLDER = re.compile(r"\{port:([^}]+)\}")
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def free_port(taken: set[int]) -> int:
    """A port the kernel considers free now, not among `taken` (other names of this graph)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


def _fill_text(text: str, ports: dict[str, int]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in ports:
            ports[name] = free_port(set(ports.values()))
        return str(ports[name])

    return _PLACEHOLDER.sub(one, text)


def _fill_spec(spec: ProcessSpec, ports: dict[str, int]) -> ProcessSpec:
    return msgspec.structs.replace(
        spec,
        argv=[_fill_text(a, ports) for a in spec.argv],
        env={k: _fill_text(v, ports) for k, v in spec.env.items()},
        readiness=msgspec.structs.replace(spec.readiness, target=_fill_text(spec.readiness.target, ports)),
        # An `auto` port's name is its placeholder's; one the command line never used stays "auto".
        ports={n: (ports.get(n, "auto") if p == "auto" else p) for n, p in spec.ports.items()},
    )


def fill_plan(plan: Plan, ports: dict[str, int]) -> Plan:
    """The plan with every placeholder replaced; new names are added to `ports` (mutated)."""
    processes = [_fill_spec(p, ports) for p in plan.processes]
    return msgspec.structs.replace(plan, processes=processes)


def plan_ports(plan: Plan) -> set[int]:
    """Every port a (filled) plan's local processes listen on, to check after `down` (a remote
    host's are its processes', which `down` finds there by the graph's tag)."""
    return {
        p for spec in plan.processes if spec.host == LOCAL for p in spec.ports.values() if isinstance(p, int)
    }


def listening(port: int) -> bool:
    """Whether a TCP socket of this network namespace listens on `port`, on any address (managed
    etcd and nats bind the advertised address, not 127.0.0.1)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == _TCP_LISTEN and int(local.rpartition(":")[2], 16) == port:
                return True
    return False
