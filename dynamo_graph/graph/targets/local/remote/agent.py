"""The remote end of the ssh launcher: a small program the supervisor runs on a remote host over
ssh, with the host's own python (`python -m dynamo_graph.graph.targets.local.remote.agent COMMAND`).

    run     start one process of the plan and watch over it (see below)
    attach  hand this ssh channel to the `run` agent of a process whose channel was lost
    scan    list (and with --kill, stop) the processes of a graph on this host
    probe   what preflight needs to know: versions, paths, model files, engine packages, env,
            GPUs, ports taken
    ports   N free ports on this host (for `auto` ports of processes that run here)

`run` and `attach`, the watchdog that keeps a remote process from running unsupervised and lets
a supervisor re-attach to it over a new connection, are in agent_run.py. Every process of a
graph carries `DYNGRAPH_PROC=<graph id>/<name>` in its environment, which `scan` looks for (and
`dyngraph down` runs `scan --kill` on every host).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
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
from dynamo_graph.graph.targets.local.remote.agent_run import TAG_ENV, attach, clear_sockets, run

HEARTBEAT_S = 2.0  # how often the supervisor pings an agent; 3 missed and the agent stops its process
REATTACH_S = 10.0  # how long a process outlives its lost channel, waiting for its supervisor to re-attach
MODULE = "dynamo_graph.graph.targets.local.remote.agent"


# ---- the supervisor's side of the protocol (ssh.py, and the shell script of ../shell.py) --------


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
    files: dict[str, str] | None = None,
) -> str:
    """The line `run` reads on stdin; with `heartbeat_s` > 0 the sender must then write a line
    (`ping`) at least that often, or the agent takes it for gone; with `reattach_s` > 0 the
    process outlives a lost channel that long, for `attach`. `files` (env variable -> file
    contents: TLS keys and certificates) are written to files only the user can read on the host,
    and each variable is pointed at its file."""
    request = {"argv": argv, "env": env, "workdir": workdir, "tag": tag, "grace_s": grace_s}
    request |= {"heartbeat_s": heartbeat_s, "reattach_s": reattach_s, "files": files or {}}
    return json.dumps(request) + "\n"


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
    """NVIDIA GPUs on this host, and why there are none when none are found: `nvidia-smi -L`,
    else NVML (libnvidia-ml, which the driver installs even where nvidia-smi is not on PATH)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return _nvml_gpu_count()
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"nvidia-smi failed: {e}"
    if out.returncode != 0:
        return 0, f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:200]}"
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")), ""


def _nvml_gpu_count() -> tuple[int, str]:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0, "no NVIDIA GPU found: nvidia-smi is not on PATH and the NVML library is not installed"
    if (code := nvml.nvmlInit_v2()) != 0:
        return 0, f"NVML could not start (error {code}): is the NVIDIA driver loaded?"
    count = ctypes.c_uint(0)
    try:
        code = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
    finally:
        nvml.nvmlShutdown()
    return (count.value, "") if code == 0 else (0, f"NVML could not count GPUs (error {code})")


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


TOKENIZER_FILES = ("tokenizer.json",)
"""What the pre/post-processor loads a model's tokenizer from (llm/model_source.py), unless the
model is a GGUF, which embeds its own."""


def model_problem(path: str, config: str | None, gguf: bool) -> str | None:
    """Why a worker could not load the model at `path` (with `--model-config` folder `config`), or
    None. `gguf`: the engine (llama.cpp) needs a .gguf file, or a folder with one."""
    model = Path(path).expanduser()
    if not model.exists():
        return "does not exist"
    if model.is_file():
        return (
            None
            if model.suffix.lower() == ".gguf"
            else "is a file but not a .gguf (give an HF model's folder)"
        )
    if gguf:
        return None if any(model.glob("*.gguf")) else "holds no .gguf file, which llama.cpp needs"
    folders = [model, *([Path(config).expanduser()] if config else [])]
    lacks = []
    if not any((f / name).is_file() for f in folders for name in TOKENIZER_FILES):
        lacks.append(" or ".join(TOKENIZER_FILES))
    if not (model / "config.json").is_file():
        lacks.append("config.json")
    return f"is not a Hugging Face model folder: it has no {' and no '.join(lacks)}" if lacks else None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


def answer(ask: dict[str, Any]) -> dict[str, Any]:
    """What preflight asked about this host (see `probe`), found by this interpreter."""
    gpus, gpu_note = gpu_count() if ask.get("gpus") else (None, "")
    models = {p: why for p, config, gguf in ask.get("models", []) if (why := model_problem(p, config, gguf))}
    hubs = {}
    if ask.get("hubs"):
        from dynamo_graph.graph.targets.local.remote.hub_probe import hub_problem

        hubs = {repo: why for repo, env in ask["hubs"] if (why := hub_problem(repo, env))}
    return {
        "version": dynamo_graph.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "missing": [p for p in ask.get("paths", []) if not Path(p).expanduser().exists()],
        "models": models,
        "hubs": hubs,
        "modules_missing": [m for m in ask.get("modules", []) if not _importable(m)],
        "env_unset": [n for n in ask.get("env", []) if not os.environ.get(n, "").strip()],
        "gpus": gpus,
        "gpu_note": gpu_note,
        "taken": [[h, p] for h, p in ask.get("ports", []) if port_taken(h, p)],
    }


def probe() -> int:
    """Reads `{"paths": [...], "models": [[path, config, gguf], ...], "hubs": [[repo_id, {HF_*
    env}], ...], "modules": [...], "env": [...], "gpus": bool, "ports": [[host, port], ...]}`
    (each optional); prints what it found."""
    print(json.dumps(answer(json.loads(sys.stdin.readline()))))
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
