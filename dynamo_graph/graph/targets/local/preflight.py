"""Preflight of `dyngraph up` (and `dyngraph validate --preflight`): everything that would make
the graph fail on its hosts, found before anything starts, all at once, each problem with its
host, graph key and file:line.

What each host must have comes from the plan: model folders that hold a tokenizer and a config
(or a GGUF, for llama.cpp), hub ids that are cached there or can be downloaded (hub_probe.py),
`--model-config` folders, `engine_args_file`s, Python engine files and frontends' keys files;
the Python package of each worker's engine, importable by the interpreter that will run it; the
variables a frontend's `api_key_env` names, set in that host's environment; the GPUs the
placement hands out (CUDA_VISIBLE_DEVICES), counted with nvidia-smi or NVML; and pinned ports
free. The agent's `answer` (agent.py) finds all of that on a host.

On every remote host (all at the same time): the ssh connection (reachable, host key, login),
then one run of the agent's `probe` with the host's python, which also tells whether that python
runs dyngraph at a compatible version. On this host the probe runs as a subprocess of the
interpreter that runs local processes (`hosts.local.venv` / `python`, else this one), so engine
packages are looked up on its sys.path, not this process's. Port checks are skipped when the
graph already runs (its own processes hold them). A graph with problems raises GraphError: the
CLI prints it and exits 2, and nothing has been started anywhere.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_graph import __version__
from dynamo_graph.engines.registry import ENGINES, GPU_FREE_ENGINES, engine_file
from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.paths import CHECKOUT_TINY_MODEL, TINY_MODEL_DIR
from dynamo_graph.graph.plan import Plan, ProcessSpec
from dynamo_graph.graph.schema import LOCAL, Frontend, Graph, Worker
from dynamo_graph.graph.targets.local.remote import agent
from dynamo_graph.graph.targets.local.remote.hub_probe import HF_ENV
from dynamo_graph.graph.validate import SourceLocator, fixed_ports, locate
from dynamo_graph.llm.model_source import hub_repo_id

if TYPE_CHECKING:  # ssh.py (and asyncssh) load only for a plan with remote hosts
    from dynamo_graph.graph.targets.local.remote.ssh import SshError, SshHosts

MIN_PYTHON = (3, 11)
ANY_ADDRESS = "0.0.0.0"  # a port held on any interface cannot be bound here
LOCAL_PROBE_TIMEOUT_S = 30.0


@dataclass
class _HostNeeds:
    """What the plan needs of one host, each item with the graph key it comes from."""

    paths: dict[str, str] = field(default_factory=dict)  # path -> key
    models: dict[str, tuple[str, str | None, bool]] = field(default_factory=dict)  # path -> key, config, gguf
    hubs: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)  # repo id -> key, HF_* env
    modules: dict[str, dict[str, str]] = field(default_factory=dict)  # package -> {key: engine}
    env: dict[str, str] = field(default_factory=dict)  # variable -> key
    gpus: int = 0
    gpu_users: list[str] = field(default_factory=list)
    ports: dict[int, str] = field(default_factory=dict)  # port -> key
    workdir: str | None = None  # where the host's processes run

    def ask(self) -> dict[str, Any]:
        """What the agent's `answer` is asked on the host."""
        return {
            "paths": sorted(self.paths),
            "models": [[p, config, gguf] for p, (_, config, gguf) in sorted(self.models.items())],
            "hubs": [[repo, env] for repo, (_, env) in sorted(self.hubs.items())],
            "modules": sorted(self.modules),
            "env": sorted(self.env),
            "gpus": self.gpus > 0,
            "ports": [[ANY_ADDRESS, p] for p in self.ports],
        }


def _flag(spec: ProcessSpec, flag: str) -> str | None:
    return spec.argv[spec.argv.index(flag) + 1] if flag in spec.argv else None


def _worker_needs(need: _HostNeeds, spec: ProcessSpec, key: str, worker: Worker) -> None:
    """Files a worker reads, the hub model it fetches and the engine package it imports. Relative
    paths that compile left as written are hub ids (`org/name`), resolved from the host's cache
    (or downloaded) when the worker starts."""
    from dynamo_graph.engines import ENGINE_PACKAGES  # a dict; the engines themselves load lazily

    where = f"components.{key}"
    model, config = _flag(spec, "--model-path"), _flag(spec, "--model-config")
    if model is not None and model.startswith("/"):
        gguf = worker.engine == "llamacpp"
        need.models.setdefault(model, (f"models.{worker.model}.path", config, gguf))
    elif model is not None and (repo := hub_repo_id(model)) is not None:
        hf_env = {name: spec.env[name] for name in HF_ENV if name in spec.env}
        need.hubs.setdefault(repo, (f"models.{worker.model}.path", hf_env))
    if config is not None and config.startswith("/"):
        need.paths.setdefault(config, f"models.{worker.model}.config")
    if (args := _flag(spec, "--extra-engine-args")) is not None and worker.engine_args_file is not None:
        need.paths.setdefault(args, f"{where}.engine_args_file")
    if (given := engine_file(next(a for a in spec.argv if a.startswith("out="))[4:])) is not None:
        need.paths.setdefault(given[1], f"{where}.engine")
    if (package := ENGINE_PACKAGES.get(worker.engine)) is not None:
        need.modules.setdefault(package, {})[f"{where}.engine"] = worker.engine


def _needs(graph: Graph, plan: Plan, check_ports: bool) -> dict[str, _HostNeeds]:
    needs: dict[str, _HostNeeds] = {}
    for spec in [*plan.processes, *plan.standby]:  # standby: the autoscaler may start them
        need = needs.setdefault(spec.host, _HostNeeds())
        comp = graph.components.get(spec.component)
        if isinstance(comp, Worker):
            _worker_needs(need, spec, spec.component, comp)
        elif isinstance(comp, Frontend):
            for i, name in enumerate(comp.api_key_env):
                if name not in spec.env:
                    need.env.setdefault(name, f"components.{spec.component}.api_key_env.{i}")
            if keys_file := _flag(spec, "--api-keys-file"):
                need.paths.setdefault(keys_file, f"components.{spec.component}.auth.keys_file")
        if spec.argv[0] == "dyngraph":  # not managed etcd / nats, which run in the state dir
            need.workdir = spec.workdir
        if graph.host(spec.host).workdir:
            need.paths.setdefault(spec.workdir, f"hosts.{spec.host}.workdir")
        pretends = isinstance(comp, Worker) and comp.engine in GPU_FREE_ENGINES  # validate.gpu_warnings
        if (devices := spec.env.get("CUDA_VISIBLE_DEVICES")) and not pretends:
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
    from dynamo_graph.graph.targets.local.remote.ssh import AuthRefused, HostKeyRefused

    ssh = graph.host(host).ssh
    assert ssh is not None
    if isinstance(error, HostKeyRefused):
        return f"hosts.{host}.ssh.host_key" if ssh.host_key else f"hosts.{host}.ssh.known_hosts"
    if isinstance(error, AuthRefused) and ssh.identity_file:
        return f"hosts.{host}.ssh.identity_file"
    return f"hosts.{host}.ssh.address"


def _found(
    graph: Graph, host: str, need: _HostNeeds, found: dict[str, Any], python: str
) -> Iterator[Problem]:
    """Problems from what the agent found on a host (remote or local) against what it needs."""
    remote = host != LOCAL
    where, there = (f"host {host!r}: ", " there") if remote else ("", "")
    for path in found["missing"]:
        yield Problem(need.paths[path], f"{where}{path} does not exist{there}")
    for path, why in found.get("models", {}).items():
        hint = ""
        if not remote and why == "does not exist" and Path(path).name == TINY_MODEL_DIR:
            hint = f"; build the tiny test model there with `dyngraph dev tiny-model {path}`"
            if Path(path) == CHECKOUT_TINY_MODEL:
                hint += " (or `make tiny-model` in the checkout)"
        yield Problem(need.models[path][0], f"{where}{path} {why}{there}{hint}")
    for repo, why in found.get("hubs", {}).items():
        yield Problem(need.hubs[repo][0], f"{where}model {repo!r} {why}{there}")
    for package in found.get("modules_missing", []):
        for key, engine in need.modules[package].items():
            yield Problem(
                key,
                f"{where}engine {engine} needs the Python package {package!r}, which {python} cannot "
                f"import{there}: install it with {ENGINES[engine].install}",
            )
    for name in found.get("env_unset", []):
        yield Problem(
            need.env[name],
            f"{where}environment variable {name} is not set{there}: the frontend refuses to start "
            "without the API key it names; set it where `dyngraph up` runs (or in the component's env)",
        )
    gpus = found["gpus"]
    if gpus is not None and gpus < need.gpus:
        users = ", ".join(need.gpu_users)
        note = found["gpu_note"]
        yield Problem(
            f"hosts.{host}.gpus",
            f"host {host!r}: the placement needs {need.gpus} GPU(s) there ({users}) but the host has "
            f"{gpus}" + (f" ({note})" if note else ""),
        )
    for _, port in found["taken"]:
        yield Problem(
            need.ports[port],
            f"port {port} is already taken on host {host!r}: stop what listens there, or give "
            f"another on the command line: {need.ports[port]}=PORT",
        )


def _probe_problems(graph: Graph, host: str, python: str, need: _HostNeeds, out: str) -> Iterator[Problem]:
    found = json.loads(out)
    where = f"host {host!r}"
    version = tuple(int(x) for x in found["python"].split(".")[:2])
    if version < MIN_PYTHON:
        yield Problem(
            _python_key(graph, host),
            f"{where}: {python} is Python {found['python']}; dyngraph needs "
            f"{'.'.join(map(str, MIN_PYTHON))} or newer",
        )
    if found["version"].split(".")[:2] != __version__.split(".")[:2]:
        yield Problem(
            _python_key(graph, host),
            f"{where}: {python} has dyngraph {found['version']}; this one is {__version__}, and "
            f"the two must share major.minor (install dyngraph {__version__} there)",
        )
    yield from _found(graph, host, need, found, python)


def _agent_failed(python: str, exit_status: int | None, stderr: str) -> str | None:
    """Why `python -m <agent>` did not answer, or None when it did."""
    if exit_status == 127 or "No such file" in stderr:
        return f"{python} not found"
    if "No module named" in stderr:
        return f"dyngraph is not installed for {python} (need dyngraph {__version__})"
    if exit_status != 0:
        return f"{python} could not run dyngraph's agent: {stderr.strip()[-300:]}"
    return None


async def _check_remote(graph: Graph, pool: SshHosts, host: str, need: _HostNeeds) -> list[Problem]:
    from dynamo_graph.graph.targets.local.remote.ssh import SshError, describe, last_line

    remote = pool.hosts[host]
    try:
        done = await pool.run(host, "probe", stdin=json.dumps(need.ask()) + "\n")
    except SshError as e:
        return [Problem(_ssh_key(graph, host, e), str(e))]
    if why := _agent_failed(remote.python, done.exit_status, done.stderr):
        return [Problem(_python_key(graph, host), f"{describe(host, remote)}: {why}")]
    return list(_probe_problems(graph, host, remote.python, need, last_line(done.stdout)))


def _check_local(graph: Graph, plan: Plan, need: _HostNeeds) -> list[Problem]:
    """The agent's probe run by the interpreter that runs local processes (see local.command_line),
    so that engine packages are looked up on its sys.path, not this process's."""
    python = plan.local_python or sys.executable
    # In their workdir, as they run: `python -m` puts it first on sys.path.
    cwd = need.workdir if need.workdir and Path(need.workdir).is_dir() else "/"
    try:
        done = subprocess.run(
            [python, "-m", agent.MODULE, "probe"],
            input=json.dumps(need.ask()) + "\n",
            capture_output=True,
            text=True,
            timeout=LOCAL_PROBE_TIMEOUT_S,
            cwd=cwd,
        )
    except FileNotFoundError:
        why: str | None = f"{python} not found"
    except subprocess.TimeoutExpired:
        why = f"{python} did not answer dyngraph's agent in {LOCAL_PROBE_TIMEOUT_S:g} s"
    else:
        why = _agent_failed(python, done.returncode, done.stderr)
    if why:
        return [Problem(_python_key(graph, LOCAL), f"host 'local': {why}")]
    return list(_probe_problems(graph, LOCAL, python, need, done.stdout.splitlines()[-1]))


async def _check_all(graph: Graph, plan: Plan, check_ports: bool) -> list[Problem]:
    needs = _needs(graph, plan, check_ports)
    local = [asyncio.to_thread(_check_local, graph, plan, needs[LOCAL])] if LOCAL in needs else []
    if not plan.hosts:
        return [p for found in await asyncio.gather(*local) for p in found]
    from dynamo_graph.graph.targets.local.remote.ssh import SshHosts

    pool = SshHosts(dict(plan.hosts), tries=1)  # preflight reports an unreachable host at once
    try:
        remote = (_check_remote(graph, pool, h, needs[h]) for h in sorted(plan.hosts))
        found = await asyncio.gather(*local, *remote)  # every host at the same time, this one too
    finally:
        await pool.close()
    return [p for host in found for p in host]


def preflight(
    graph: Graph, plan: Plan, source: SourceLocator | None, file: str, *, check_ports: bool
) -> None:
    """Raises GraphError with every problem found on every host of the plan."""
    problems = asyncio.run(_check_all(graph, plan, check_ports))
    if problems:
        raise GraphError([locate(p, source, file) for p in problems])
