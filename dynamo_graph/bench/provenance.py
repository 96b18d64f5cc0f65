"""What a result measured: the compiled graph (its hash), the graph file's git commit, the
dyngraph version and the machine, so that two results can be told apart months later."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from dynamo_graph import __version__
from dynamo_graph.graph.plan import Plan


def plan_hash(plan: Plan) -> str:
    """sha256 of the compiled plan, with the state dir, the graph's folder and its git work tree
    written as placeholders: the same graph in another checkout hashes the same (paths such as
    `../../.cache/model` resolve inside the work tree), any change to what runs (argv, env,
    replicas, engine args) does not."""
    text = msgspec.json.encode(plan, order="sorted").decode()
    folder = Path(plan.graph_file).parent
    places = [(plan.state_dir, "$STATE_DIR"), (str(folder), "$GRAPH_DIR")]
    if (top := _git(folder, "rev-parse", "--show-toplevel")) is not None:
        places.append((top, "$WORK_TREE"))
    for place, placeholder in places:
        text = text.replace(place, placeholder)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _git(folder: Path, *args: str) -> str | None:
    if shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_of(file: Path) -> dict | None:
    """The commit that last changed `file`, and whether it differs from that commit now; None
    outside a git work tree."""
    folder = file.resolve().parent
    commit = _git(folder, "log", "-1", "--format=%H", "--", file.name)
    if commit is None:
        return None
    status = _git(folder, "status", "--porcelain", "--", file.name)
    return {
        "commit": commit or None,  # empty: the file was never committed
        "head": _git(folder, "rev-parse", "HEAD"),
        "dirty": bool(status),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return round(pages * size / 2**30, 1)


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def machine() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
    }


def _command_line() -> list[str]:
    """This process's command line, with the value of --api-key masked."""
    program = Path(sys.argv[0]).name
    argv = ["dyngraph" if program == "__main__.py" else program, *sys.argv[1:]]  # python -m dynamo_graph
    for i, arg in enumerate(argv):
        if arg.startswith("--api-key="):
            argv[i] = "--api-key=***"
        elif i and argv[i - 1] == "--api-key":
            argv[i] = "***"
    return argv


def provenance() -> dict:
    """The fields every result carries, graph or not."""
    return {
        "dyngraph_version": __version__,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": _command_line(),
        "machine": machine(),
    }


def graph_provenance(plan: Plan, overrides: list[str]) -> dict:
    file = Path(plan.graph_file)
    return {
        "name": plan.graph,
        "file": str(file),
        "overrides": overrides,
        "hash": plan_hash(plan),
        "git": git_of(file),
    }
