"""`render -f shell`: the local target's plan as a shell script a person could run by hand.

It starts a remote host's processes as `up` does: `ssh` to the host running dyngraph's agent
there, which reads the process (argv, env, workdir) from stdin and stops it when stdin closes.
With `security.tls` on, the script first issues the certificates as `up` does (graph/tls.py) and
puts the files a remote process needs into its request when it runs (read from the state dir
then, never written into the script).
Like every rendering it is deterministic and shows secrets as `***` (graph/render.py).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable

from dynamo_graph.graph.plan import LOCAL, Plan, ProcessSpec, RemoteHost
from dynamo_graph.graph.render import redact_plan
from dynamo_graph.graph.schema import Graph
from dynamo_graph.graph.targets.local.remote import agent

_PLACEHOLDER = re.compile(r"\{port:([^}]+)\}")
_FILE_MARK = "@@file@@"  # a carried file's path in a request, read into it when the script runs
_FILE = re.compile(f"{_FILE_MARK}([^@]+){_FILE_MARK}")
_ADDRESS = re.compile(r"^(?:https?://)?\[?([^\]/]+?)\]?:(\d+|\{port:[^}]+\})")  # host, port of a probe target


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
    if plan.tls is not None:
        names = json.dumps(plan.tls.names, sort_keys=True)
        issue = [
            plan.local_python or "python3",
            "-m",
            "dynamo_graph.graph.tls",
            plan.tls.dir,
            plan.graph,
            names,
        ]
        lines.append(" ".join(shlex.quote(w) for w in issue))
        if any(p.carry for p in plan.processes):
            lines.append('pem_json() { awk \'{printf "%s\\\\n", $0}\' "$1"; }  # a PEM file, JSON-escaped')

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
        if proc.mpi_hosts:  # `up` refuses it here (slurm/commands.py): it needs an MPI launcher
            world = len(proc.mpi_hosts) * proc.mpi_tasks
            lines.append(
                f"# one MPI world of {world} tasks, {proc.mpi_tasks} on each of {', '.join(proc.mpi_hosts)}: "
                f"run this under `mpirun -np {world} -H "
                + ",".join(f"<{h}>:{proc.mpi_tasks}" for h in proc.mpi_hosts)
                + "` (or `up --target slurm`)"
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
    files = {var: f"{_FILE_MARK}{proc.env[var]}{_FILE_MARK}" for var in proc.carry}
    request = agent.run_request(
        proc.argv,
        proc.env,
        proc.workdir,
        f"{tag}/{proc.name}",
        proc.shutdown_grace_s,
        agent.HEARTBEAT_S,
        0.0,
        files,
    )
    quoted = _FILE.sub(lambda m: "'\"$(pem_json " + shlex.quote(m.group(1)) + ")\"'", sub(request.rstrip()))
    pings = f"while sleep {agent.HEARTBEAT_S:g}; do echo ping; done"
    return f"{{ printf '%s\\n' {quoted}; {pings}; }} | {' '.join(words)} &"
