"""Preflight of `dyngraph up`: everything that would make the graph fail on its hosts, found before
anything starts, all at once, each problem with its host, graph key and file:line.

On every remote host (all at the same time): the ssh connection (reachable, host key, login),
then one run of the agent's `probe`, which tells whether the host's python runs dyngraph at a
compatible version, which model files (and workdir) are missing there, how many GPUs `nvidia-smi` sees (when
the plan gives that host any) and which pinned ports are taken. On this host: pinned ports and,
when the plan gives it GPUs, the GPU count. Port checks are skipped when the graph already runs
(its own processes hold them). A graph with problems raises GraphError: the CLI prints it and
exits 2, and nothing has been started anywhere.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynamo_graph import __version__
from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import Plan, RemoteHost
from dynamo_graph.graph.schema import LOCAL, Graph
from dynamo_graph.graph.supervise import agent
from dynamo_graph.graph.validate import SourceLocator, fixed_ports, locate

if TYPE_CHECKING:  # ssh.py (and asyncssh) load only for a plan with remote hosts
    from dynamo_graph.graph.supervise.ssh import SshError, SshHosts

MIN_PYTHON = (3, 11)
ANY_ADDRESS = "0.0.0.0"  # a port held on any interface cannot be bound here


@dataclass
class _HostNeeds:
    """What the plan needs of one host, each item with the graph key it comes from."""

    paths: dict[str, str] = field(default_factory=dict)  # path -> key
    gpus: int = 0
    gpu_users: list[str] = field(default_factory=list)
    ports: dict[int, str] = field(default_factory=dict)  # port -> key


def _needs(graph: Graph, plan: Plan, check_ports: bool) -> dict[str, _HostNeeds]:
    needs: dict[str, _HostNeeds] = {}
    for spec in plan.processes:
        need = needs.setdefault(spec.host, _HostNeeds())
        comp = graph.components.get(spec.component)
        model = getattr(comp, "model", None)
        for flag, key in (("--model-path", "path"), ("--model-config", "config")):
            if model is not None and flag in spec.argv:
                path = spec.argv[spec.argv.index(flag) + 1]
                if path.startswith("/"):  # not a hub id, which resolves from the host's cache
                    need.paths.setdefault(path, f"models.{model}.{key}")
        if spec.host != LOCAL and graph.host(spec.host).workdir:
            need.paths.setdefault(spec.workdir, f"hosts.{spec.host}.workdir")
        if devices := spec.env.get("CUDA_VISIBLE_DEVICES"):
            need.gpus = max(need.gpus, 1 + max(int(d) for d in devices.split(",")))
            need.gpu_users.append(spec.name)
    if check_ports:
        for host, port, key in fixed_ports(graph):
            needs.setdefault(host, _HostNeeds()).ports.setdefault(port, key)
    return needs


def _python_key(graph: Graph, host: str) -> str:
    return f"hosts.{host}.venv" if graph.host(host).venv else f"hosts.{host}.python"


def _ssh_key(graph: Graph, host: str, error: SshError) -> str:
    """The graph key to change for a failed ssh connection."""
    from dynamo_graph.graph.supervise.ssh import AuthRefused, HostKeyRefused

    ssh = graph.host(host).ssh
    assert ssh is not None
    if isinstance(error, HostKeyRefused):
        return f"hosts.{host}.ssh.host_key" if ssh.host_key else f"hosts.{host}.ssh.known_hosts"
    if isinstance(error, AuthRefused) and ssh.identity_file:
        return f"hosts.{host}.ssh.identity_file"
    return f"hosts.{host}.ssh.address"


def _found(
    graph: Graph, host: str, need: _HostNeeds, gpus: int | None, note: str, taken: list[int]
) -> Iterator[Problem]:
    """Problems from what was found on a host (remote or local) against what it needs."""
    if gpus is not None and gpus < need.gpus:
        users = ", ".join(need.gpu_users)
        yield Problem(
            f"hosts.{host}.gpus",
            f"host {host!r}: the placement needs {need.gpus} GPU(s) there ({users}) but the host has "
            f"{gpus}" + (f" ({note})" if note else ""),
        )
    for port in taken:
        yield Problem(need.ports[port], f"port {port} is already taken on host {host!r}")


def _probe_problems(
    graph: Graph, host: str, remote: RemoteHost, need: _HostNeeds, out: str
) -> Iterator[Problem]:
    found = json.loads(out)
    where = f"host {host!r}"
    python = tuple(int(x) for x in found["python"].split(".")[:2])
    if python < MIN_PYTHON:
        yield Problem(
            _python_key(graph, host),
            f"{where}: {remote.python} is Python {found['python']}; dyngraph needs "
            f"{'.'.join(map(str, MIN_PYTHON))} or newer",
        )
    if found["version"].split(".")[:2] != __version__.split(".")[:2]:
        yield Problem(
            _python_key(graph, host),
            f"{where}: {remote.python} has dyngraph {found['version']}; this one is {__version__}, and "
            f"the two must share major.minor (install dyngraph {__version__} there)",
        )
    for path in found["missing"]:
        yield Problem(need.paths[path], f"{where}: {path} does not exist there")
    yield from _found(graph, host, need, found["gpus"], found["gpu_note"], [p for _, p in found["taken"]])


async def _check_remote(graph: Graph, pool: SshHosts, host: str, need: _HostNeeds) -> list[Problem]:
    from dynamo_graph.graph.supervise.ssh import SshError, describe, last_line

    remote = pool.hosts[host]
    ask = {
        "paths": sorted(need.paths),
        "gpus": need.gpus > 0,
        "ports": [[ANY_ADDRESS, p] for p in need.ports],
    }
    try:
        done = await pool.run(host, "probe", stdin=json.dumps(ask) + "\n")
    except SshError as e:
        return [Problem(_ssh_key(graph, host, e), str(e))]
    stderr = done.stderr
    if done.exit_status == 127 or "No such file" in stderr:
        why = f"{remote.python} not found"
    elif "No module named" in stderr:
        why = f"dyngraph is not installed for {remote.python} (need dyngraph {__version__})"
    elif done.exit_status != 0:
        why = f"{remote.python} could not run dyngraph's agent: {stderr.strip()[-300:]}"
    else:
        return list(_probe_problems(graph, host, remote, need, last_line(done.stdout)))
    return [Problem(_python_key(graph, host), f"{describe(host, remote)}: {why}")]


def _check_local(graph: Graph, need: _HostNeeds) -> list[Problem]:
    gpus, note = agent.gpu_count() if need.gpus else (None, "")
    taken = [p for p in need.ports if agent.port_taken(ANY_ADDRESS, p)]
    return list(_found(graph, LOCAL, need, gpus, note, taken))


async def _check_all(graph: Graph, plan: Plan, check_ports: bool) -> list[Problem]:
    needs = _needs(graph, plan, check_ports)
    problems = _check_local(graph, needs[LOCAL]) if LOCAL in needs else []
    if not plan.hosts:
        return problems
    from dynamo_graph.graph.supervise.ssh import SshHosts

    pool = SshHosts(dict(plan.hosts), tries=1)  # preflight reports an unreachable host at once
    try:
        found = await asyncio.gather(*(_check_remote(graph, pool, h, needs[h]) for h in sorted(plan.hosts)))
    finally:
        await pool.close()
    return problems + [p for host in found for p in host]


def preflight(
    graph: Graph, plan: Plan, source: SourceLocator | None, file: str, *, check_ports: bool
) -> None:
    """Raises GraphError with every problem found on every host of the plan."""
    problems = asyncio.run(_check_all(graph, plan, check_ports))
    if problems:
        raise GraphError([locate(p, source, file) for p in problems])
