"""`dyngraph render`: a graph and its plan as YAML, JSON, a shell script, or a mermaid drawing.

All four are deterministic text (a test renders twice and compares bytes), so they can be
committed, diffed in review and used as a dry run of `dyngraph up`. The shell script starts a
remote host's processes as `up` does: `ssh` to the host running dyngraph's agent there, which
reads the process (argv, env, workdir) from stdin and stops it when stdin closes.

Secrets never appear in them: values of environment variables and options whose names look
secret (KEY, TOKEN, SECRET, PASSWORD, CREDENTIAL, ...) and the user-info part of URLs
(`nats://user:password@host`) are replaced by `***`. API keys reach a frontend only through its
environment (`api_key_env` names the variables), so the plan holds no key of its own.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from typing import Any

import msgspec
import yaml

from dynamo_graph.graph.dynamo_k8s import render_dynamo_k8s
from dynamo_graph.graph.k8s import render_k8s
from dynamo_graph.graph.plan import LOCAL, Plan, ProcessSpec, RemoteHost
from dynamo_graph.graph.schema import Graph
from dynamo_graph.graph.slurm.script import render_slurm
from dynamo_graph.graph.supervise import agent
from dynamo_graph.graph.validate import Engines
from dynamo_graph.redact import REDACTED, is_secret_name, redact_url

FORMATS = ("yaml", "json", "shell", "mermaid", "k8s", "dynamo-k8s", "slurm")
ENGINES_OF_FORMAT: dict[str, Engines] = {"dynamo-k8s": "dynamo"}
"""Formats whose workers run another project's engines (the validation they need: validate.Engines)."""
_PLACEHOLDER = re.compile(r"\{port:([^}]+)\}")
_ADDRESS = re.compile(r"^(?:https?://)?\[?([^\]/]+?)\]?:(\d+|\{port:[^}]+\})")  # host, port of a probe target


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: REDACTED if is_secret_name(k) and v else redact_url(v) for k, v in env.items()}


def redact_argv(argv: list[str]) -> list[str]:
    out: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next:
            out.append(REDACTED)
            secret_next = False
            continue
        flag, sep, _ = arg.partition("=")
        if arg.startswith("--") and is_secret_name(flag):
            if sep:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(arg)
                secret_next = True
            continue
        out.append(redact_url(arg))
    return out


def redact(value: Any) -> Any:
    """A JSON-like document with secrets replaced (see the module's docstring)."""
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(v, str) and v and is_secret_name(str(k)) else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return redact_argv(value)
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value


def redact_plan(plan: Plan) -> Plan:
    processes = [
        msgspec.structs.replace(p, argv=redact_argv(p.argv), env=redact_env(p.env)) for p in plan.processes
    ]
    files = {path: redact_url(text) for path, text in plan.files.items()}
    return msgspec.structs.replace(plan, processes=processes, files=files)


def _document(graph: Graph, plan: Plan) -> dict[str, Any]:
    return redact({"graph": graph.model_dump(mode="json"), "plan": msgspec.to_builtins(plan)})


def render_yaml(graph: Graph, plan: Plan) -> str:
    return yaml.safe_dump(_document(graph, plan), sort_keys=False, default_flow_style=False, width=120)


def render_json(graph: Graph, plan: Plan) -> str:
    return json.dumps(_document(graph, plan), indent=2) + "\n"


def _shell_var(name: str) -> str:
    return "PORT_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def render_shell(graph: Graph, plan: Plan) -> str:
    """The commands a person could run by hand, in dependency order, auto ports picked first; a
    process others depend on with a tcp or http readiness probe (managed etcd and nats) is waited
    for until its port answers. Secrets show as `***`: set them before running it."""
    plan = redact_plan(plan)
    lines = [
        "#!/usr/bin/env bash",
        f"# dyngraph plan for graph {plan.graph!r} ({plan.graph_file})",
        "set -euo pipefail",
    ]
    for key, host in plan.hosts.items():
        if host.host_key:
            var = _known_hosts_var(key)
            lines.append(f"{var}=$(mktemp)")
            lines.append(f'echo {shlex.quote(_known_hosts_line(host))} > "${var}"')
    auto = sorted(
        {m for p in plan.processes for text in [*p.argv, *p.env.values()] for m in _PLACEHOLDER.findall(text)}
    )
    owner = {name: p.host for p in plan.processes for name in p.ports}  # a port is free where it listens
    if any(owner.get(name, LOCAL) == LOCAL for name in auto):
        lines.append(
            'free_port() { python3 -c \'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); '
            "print(s.getsockname()[1])'; }"
        )
    for name in auto:
        if (host := owner.get(name, LOCAL)) in plan.hosts:
            ask = shlex.quote(agent.command(plan.hosts[host].python, "ports", "1"))
            lines.append(
                f"{_shell_var(name)}=$({' '.join(_ssh_words(host, plan.hosts[host]))} {ask} | tr -d '[]')"
            )
        else:
            lines.append(f"{_shell_var(name)}=$(free_port)")
    if any(p.workdir == plan.state_dir for p in plan.processes):  # managed etcd / nats run there
        lines.append(f"mkdir -p {shlex.quote(plan.state_dir)}")
    for path, text in plan.files.items():
        lines.append(f"mkdir -p {shlex.quote(str(path).rsplit('/', 1)[0])}")
        lines.append(f"cat > {shlex.quote(path)} <<'EOF'\n{text.rstrip()}\nEOF")

    def sub(text: str) -> str:
        quoted = shlex.quote(text)
        # Placeholders become shell variables; close and reopen the quotes around them.
        out = _PLACEHOLDER.sub(lambda m: "'\"$" + _shell_var(m.group(1)) + "\"'", quoted)
        return out.removeprefix("''").removesuffix("''")

    awaited = {d for p in plan.processes for d in p.depends_on}
    if any(p.name in awaited and p.readiness.kind != "log" for p in plan.processes):
        lines.append(
            'wait_tcp() { for _ in $(seq 600); do (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && return; '
            'sleep 0.1; done; echo "$1:$2 did not open" >&2; exit 1; }'
        )
    for proc in plan.processes:
        lines.append("")
        lines.append(
            f"# {proc.name} on {proc.host} (ready when {proc.readiness.kind} {proc.readiness.target})"
        )
        if proc.host in plan.hosts:
            lines.append(
                _remote_command(proc, proc.host, plan.hosts[proc.host], agent.graph_tag(plan.state_dir), sub)
            )
        else:
            env = " ".join(f"{k}={sub(v)}" for k, v in proc.env.items())
            argv = proc.argv
            if plan.local_python and argv[0] == "dyngraph":
                argv = [plan.local_python, "-m", "dynamo_graph", *argv[1:]]
            command = " ".join(sub(a) for a in argv)
            lines.append(f"(cd {shlex.quote(proc.workdir)} && {env + ' ' if env else ''}{command}) &")
        if proc.name in awaited and (address := _ADDRESS.match(proc.readiness.target)):
            lines.append(f"wait_tcp {sub(address.group(1))} {sub(address.group(2))}")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def _known_hosts_var(host_key: str) -> str:
    return "KNOWN_HOSTS_" + re.sub(r"[^A-Za-z0-9]", "_", host_key).upper()


def _known_hosts_line(host: RemoteHost) -> str:
    name = host.address if host.port == 22 else f"[{host.address}]:{host.port}"
    return f"{name} {host.host_key}"


def _ssh_words(key: str, host: RemoteHost) -> list[str]:
    """`ssh ... user@address`, shell-quoted, checking the host key as `up` does."""
    ssh = ["ssh", "-p", str(host.port), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
    if host.identity_file:
        ssh += ["-i", host.identity_file]
    if host.known_hosts:
        ssh += ["-o", f"UserKnownHostsFile={host.known_hosts}"]
    words = [shlex.quote(w) for w in ssh]
    if host.host_key:
        words += ["-o", f'UserKnownHostsFile="${_known_hosts_var(key)}"']
    return [*words, shlex.quote(f"{host.user}@{host.address}" if host.user else host.address)]


def _remote_command(
    proc: ProcessSpec, key: str, host: RemoteHost, tag: str, sub: Callable[[str], str]
) -> str:
    """The agent over ssh, fed the process on stdin and then a heartbeat: when they stop (the
    script is killed), the agent stops the process."""
    words = [*_ssh_words(key, host), shlex.quote(agent.command(host.python, "run"))]
    request = agent.run_request(
        proc.argv, proc.env, proc.workdir, f"{tag}/{proc.name}", proc.shutdown_grace_s, agent.HEARTBEAT_S
    )
    pings = f"while sleep {agent.HEARTBEAT_S:g}; do echo ping; done"
    return f"{{ printf '%s\\n' {sub(request.rstrip())}; {pings}; }} | {' '.join(words)} &"


def _node(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def render_mermaid(graph: Graph, plan: Plan) -> str:
    """Components, endpoints and routing: client -> frontends -> endpoints -> worker replicas."""
    out = ["flowchart LR", "  client((client))"]
    replicas: dict[str, list[str]] = {}
    for proc in plan.processes:
        replicas.setdefault(proc.component, []).append(f"{proc.name}@{proc.host}")
    for name, comp in sorted(graph.frontends().items()):
        out.append(f'  {_node(name)}["{name}<br/>http {comp.http.host}:{comp.http.port}"]')
        out.append(f"  client --> {_node(name)}")
    for name, worker in sorted(graph.workers().items()):
        endpoint = str(worker.endpoint_name())
        ep_node = "ep_" + _node(endpoint)
        out.append(f'  {ep_node}{{{{"{endpoint}"}}}}')
        model = graph.models[worker.model]
        out.append(
            f'  subgraph {_node(name)}["{name}: {worker.engine}, model {model.name}, role {worker.role}"]'
        )
        out += [f'    {_node(r)}["{r}"]' for r in replicas.get(name, [])]
        out.append("  end")
        out += [f"  {ep_node} --> {_node(r)}" for r in replicas.get(name, [])]
        step = {"prefill": "1 prefill, ", "decode": "2 decode, "}.get(worker.role, "")
        for fname, front in sorted(graph.frontends().items()):
            if front.models is None or worker.model in front.models:
                out.append(f"  {_node(fname)} -->|{step}{front.router.mode}| {ep_node}")
    # Disaggregated models: prefill workers hand each prompt's KV cache to decode workers.
    for pname, prefill in sorted(graph.workers().items()):
        if prefill.role != "prefill":
            continue
        for dname, decode in sorted(graph.workers().items()):
            if decode.role == "decode" and decode.model == prefill.model:
                out.append(f"  {_node(pname)} -.->|KV cache| {_node(dname)}")
    for infra in ("etcd", "nats"):
        if infra in replicas:
            out.append(f"  {infra}[({infra})]")
    out.append(
        f"  %% runtime: discovery {graph.runtime.discovery}, request plane {graph.runtime.request_plane}, "
        f"events {graph.runtime.event_plane}"
    )
    return "\n".join(out) + "\n"


RENDERERS = {
    "yaml": render_yaml,
    "json": render_json,
    "shell": render_shell,
    "mermaid": render_mermaid,
    "k8s": render_k8s,
    "dynamo-k8s": render_dynamo_k8s,
    "slurm": render_slurm,
}


def render(graph: Graph, plan: Plan, fmt: str) -> str:
    if fmt not in RENDERERS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    return RENDERERS[fmt](graph, plan)
