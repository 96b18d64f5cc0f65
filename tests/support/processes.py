"""Start and stop real `dyngraph` processes for tests, by PID, on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import httpx

DYNGRAPH = [sys.executable, "-m", "dynamo_graph"]
# What a worker logs once it serves: "instance <hex id> serving ...".
INSTANCE_RE = re.compile(r"instance ([0-9a-f]+) serving")


def embedded_planes_env(tmp_path: Path, *, zmq_events: bool = False) -> dict[str, str]:
    """The environment that puts frontends and workers on the embedded planes in `tmp_path`: file
    discovery, the tcp request plane (and zmq KV events), a 2 s lease."""
    env = {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path / "kv"), "DYN_REQUEST_PLANE": "tcp"}
    if zmq_events:
        env["DYN_EVENT_PLANE"] = "zmq"
    env["DYN_LEASE_TTL"] = "2"
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_refuses(port: int, address: str = "127.0.0.1") -> bool:
    """Nothing listens on `address:port` (any more)."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((address, port)) != 0


def pid_alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read (ESRCH)
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Frontend(Protocol):
    """What helpers need of a frontend: its URL (a ServerProcess, a cluster's or a graph's frontend)."""

    base_url: str


class ServerProcess:
    """A `dyngraph run in=http ...` child; stopped with SIGTERM, then SIGKILL."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log_dir: Path,
        port: int | None = None,
    ) -> None:
        """`port`: another frontend's, to share it (SO_REUSEPORT); else a free one."""
        self.port = free_port() if port is None else port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}-{time.monotonic_ns()}.log"
        full_env = {**os.environ, "DYN_TOKEN_ECHO_DELAY_MS": "0", **(env or {})}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*DYNGRAPH, "run", "in=http", *args, "--http-port", str(self.port)],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 30.0, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}{path}", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        return self.proc.returncode


@contextmanager
def running_server(
    args: Sequence[str], *, log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """A ready `ServerProcess` for a fixture to yield; afterwards it must stop cleanly (exit status 0)."""
    proc = ServerProcess(args, env=env, log_dir=log_dir)
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def echo_core_args(model_path: Path, model_name: str, *extra: str) -> list[str]:
    """`dyngraph run in=http` arguments serving `model_path` as `model_name` with the echo_core engine."""
    return ["out=echo_core", "--model-path", str(model_path), "--model-name", model_name, *extra]


def run_cli(
    args: Sequence[str],
    *,
    input_text: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "DYN_TOKEN_ECHO_DELAY_MS": "0", **(env or {})}
    return subprocess.run(
        [*DYNGRAPH, *args],
        input=input_text if input_text is not None else "",
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )


class WorkerProcess:
    """A `dyngraph run in=dyn://...` (or any command) child that tests may kill -9."""

    def __init__(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, log_dir: Path, name: str = "worker"
    ) -> None:
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        full_env = {**os.environ, "DYN_TOKEN_ECHO_DELAY_MS": "0", **(env or {})}
        self.proc = subprocess.Popen(
            list(argv), env=full_env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )

    @classmethod
    def dyngraph(cls, args: Sequence[str], **kw: object) -> WorkerProcess:
        return cls([*DYNGRAPH, "run", *args], **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def instance(self) -> str | None:
        """The instance id the worker registered under, once its log says it serves."""
        found = INSTANCE_RE.search(self.log())
        return found.group(1) if found else None

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        return self.proc.returncode
