"""The remote end of the ssh launcher: a small program the supervisor runs on a remote host over
ssh, with the host's own python (`python -m dynamo_graph.graph.supervise.agent COMMAND`).

    run     start one process of the plan and watch over it (see below)
    attach  hand this ssh channel to the `run` agent of a process whose channel was lost
    scan    list (and with --kill, stop) the processes of a graph on this host
    probe   what preflight needs to know: versions, paths, GPUs, ports taken
    ports   N free ports on this host (for `auto` ports of processes that run here)

`run` and `attach`, the watchdog that keeps a remote process from running unsupervised and lets
a supervisor re-attach to it over a new connection, are in agent_run.py. Every process of a
graph carries `DYNGRAPH_PROC=<graph id>/<name>` in its environment, which `scan` looks for (and
`dyngraph down` runs `scan --kill` on every host).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dynamo_graph
from dynamo_graph.graph.supervise.agent_run import TAG_ENV, attach, clear_sockets, run

HEARTBEAT_S = 2.0  # how often the supervisor pings an agent; 3 missed and the agent stops its process
REATTACH_S = 10.0  # how long a process outlives its lost channel, waiting for its supervisor to re-attach
MODULE = "dynamo_graph.graph.supervise.agent"


# ---- the supervisor's side of the protocol (ssh.py, and render.py's shell script) --------------


def graph_tag(state_root: Path | str) -> str:
    """The id every remote process of a graph carries (DYNGRAPH_PROC=<id>/<name>): the
    supervisor's machine and the graph's state dir, so two graphs never match each other."""
    digest = hashlib.sha1(f"{socket.gethostname()}:{Path(state_root).resolve()}".encode()).hexdigest()
    return f"dg-{digest[:16]}"


def command(python: str, *args: str) -> str:
    """The remote shell command that runs the agent with `python` (no value of any env in it)."""
    return " ".join(shlex.quote(a) for a in [python, "-m", MODULE, *args])


def run_request(
    argv: list[str],
    env: dict[str, str],
    workdir: str,
    tag: str,
    grace_s: float,
    heartbeat_s: float,
    reattach_s: float = 0.0,
) -> str:
    """The line `run` reads on stdin; with `heartbeat_s` > 0 the sender must then write a line
    (`ping`) at least that often, or the agent takes it for gone; with `reattach_s` > 0 the
    process outlives a lost channel that long, for `attach`."""
    request = {"argv": argv, "env": env, "workdir": workdir, "tag": tag, "grace_s": grace_s}
    return json.dumps({**request, "heartbeat_s": heartbeat_s, "reattach_s": reattach_s}) + "\n"


# ---- scan, probe, ports -----------------------------------------------------------------------


def _tagged(prefix: str) -> dict[int, str]:
    """pid -> tag of every process whose environment has a DYNGRAPH_PROC starting with `prefix`."""
    found = {}
    marker = f"{TAG_ENV}={prefix}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            if var.startswith(marker):
                found[int(entry.name)] = var.split(b"=", 1)[1].decode(errors="replace")
    return found


def scan(prefix: str, kill_grace: float | None) -> int:
    """Print the graph's processes on this host as JSON `{pid: tag}`; with a grace, stop them
    first (SIGTERM, the grace, SIGKILL), clear the re-attach sockets their agents left, and print
    what is still there."""
    if kill_grace is not None:
        for pid in _tagged(prefix):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + kill_grace
        while _tagged(prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in _tagged(prefix):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _tagged(prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        clear_sockets(prefix)
    print(json.dumps({str(pid): tag for pid, tag in sorted(_tagged(prefix).items())}))
    return 0


def gpu_count() -> tuple[int, str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "nvidia-smi not found"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"nvidia-smi failed: {e}"
    if out.returncode != 0:
        return 0, f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:200]}"
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")), ""


def port_taken(host: str, port: int) -> bool:
    """Whether a server could not listen on the port: SO_REUSEADDR as servers set it, so only a
    listener counts, not connections of a stopped one lingering in TIME_WAIT."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def probe() -> int:
    """Reads `{"paths": [...], "gpus": bool, "ports": [[host, port], ...]}`; prints what it found."""
    ask: dict[str, Any] = json.loads(sys.stdin.readline())
    gpus, gpu_note = gpu_count() if ask.get("gpus") else (None, "")
    print(
        json.dumps(
            {
                "version": dynamo_graph.__version__,
                "python": ".".join(map(str, sys.version_info[:3])),
                "executable": sys.executable,
                "missing": [p for p in ask.get("paths", []) if not Path(p).expanduser().exists()],
                "gpus": gpus,
                "gpu_note": gpu_note,
                "taken": [[h, p] for h, p in ask.get("ports", []) if port_taken(h, p)],
            }
        )
    )
    return 0


def free_ports(count: int, exclude: set[int]) -> list[int]:
    """`count` distinct ports the kernel has free now, none in `exclude`: all bound at once, then
    let go."""
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            sock = socket.socket()
            sock.bind(("", 0))
            if sock.getsockname()[1] in exclude:
                sock.close()
                continue
            held.append(sock)
        return [s.getsockname()[1] for s in held]
    finally:
        for sock in held:
            sock.close()


def main(args: list[str]) -> int:
    if args[:1] == ["run"]:
        return run()
    if args[:1] == ["attach"] and len(args) == 2:
        return attach(args[1])
    if args[:1] == ["scan"] and len(args) in (2, 4) and (len(args) == 2 or args[2] == "--kill"):
        return scan(args[1], float(args[3]) if len(args) == 4 else None)
    if args[:1] == ["probe"]:
        return probe()
    if args[:1] == ["ports"] and len(args) >= 2:
        print(json.dumps(free_ports(int(args[1]), {int(p) for p in args[2:]})))
        return 0
    print(
        "usage: agent run | attach TAG | scan PREFIX [--kill GRACE_S] | probe | ports N [EXCLUDE...]",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
