"""Throwaway etcd and nats-server children for tests, on 127.0.0.1, stopped by their own PID.

Each server is a `subprocess.Popen` child that gets SIGTERM when the test process dies
(`PR_SET_PDEATHSIG`, set by util-linux's `setpriv --pdeathsig` before it execs the server), so a
crashed pytest leaves no orphan. Not a `preexec_fn`: that makes Python fork() instead of vfork(),
which runs the fork handlers of the gRPC core that the etcd client loaded into this process, and
those aborted a starting nats-server or etcd now and then on a loaded machine (SIGABRT, "epoll_wait
error: Bad file descriptor" in its log). Measured start times
(docs/testing.md): etcd about 0.1 s with the fast-election flags, nats about 10 ms.
"""

from __future__ import annotations

import abc
import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def _die_with_parent(command: list[str]) -> list[str]:
    """The command, run so that it gets SIGTERM when its parent dies. Linux ties this to the
    *thread* that spawned it: start servers from a thread that outlives them (the main thread, or
    a pool thread that lives until the event loop closes)."""
    return [_require("setpriv"), "--pdeathsig", "TERM", "--", *command]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise FileNotFoundError(f"{binary} not found on PATH (apt-get install -y etcd-server nats-server)")
    return path


class _ServerProc(abc.ABC):
    """A server child with stop (SIGTERM, then SIGKILL after 3 s), kill and restart."""

    def __init__(self, tmp_dir: Path, name: str) -> None:
        self.tmp_dir = tmp_dir
        self.log_path = tmp_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0

    @abc.abstractmethod
    def _command(self) -> list[str]: ...

    @abc.abstractmethod
    def _wait_ready(self, deadline: float) -> None: ...

    def _spawn(self, timeout: float = 10.0) -> None:
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                _die_with_parent(self._command()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready(started + timeout)
        except Exception:
            self.kill()
            raise
        self.startup_s = time.monotonic() - started

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self._command()[0]} exited with {self.proc.returncode}:\n"
                f"{self.log_path.read_text(errors='replace')[-4000:]}"
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop (if running) and start again on the same ports and data dir."""
        self.stop()
        self._spawn()


class EtcdProc(_ServerProc):
    """A single-member etcd with fast elections (leader in about 0.1 s; min lease TTL about 1 s)."""

    def __init__(self, tmp_dir: Path) -> None:
        super().__init__(tmp_dir, "etcd")
        self.binary = _require("etcd")
        self.port = _free_port()
        self.peer_port = _free_port()
        self.data_dir = tmp_dir / "etcd-data"
        self.url = f"http://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name=t0",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=t0={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-level=error",
            "--heartbeat-interval=10",
            "--election-timeout=100",
        ]

    def _wait_ready(self, deadline: float) -> None:
        """`/health` answers true only once a leader is elected (a TCP connect is not enough)."""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.01)
        raise TimeoutError(f"etcd not healthy at {self.url}")


class NatsProc(_ServerProc):
    """nats-server on a port it picks itself (`-p -1`), kept for restarts."""

    def __init__(self, tmp_dir: Path, *, jetstream: bool = False) -> None:
        super().__init__(tmp_dir, "nats")
        self.binary = _require("nats-server")
        self.jetstream = jetstream
        self.port: int | None = None
        self.url = ""

    def _command(self) -> list[str]:
        port = str(self.port) if self.port is not None else "-1"
        cmd = [self.binary, "-a", "127.0.0.1", "-p", port, "--ports_file_dir", str(self.tmp_dir)]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self.tmp_dir / "js")]
        return cmd

    def _wait_ready(self, deadline: float) -> None:
        """Read the URL from `nats-server_<pid>.ports`, then confirm with a TCP connect."""
        assert self.proc is not None
        ports_file = self.tmp_dir / f"nats-server_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                url = json.loads(ports_file.read_text())["nats"][0]
                host, port = url.removeprefix("nats://").rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=1):
                    self.url, self.port = url, int(port)
                    return
            except (OSError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.005)
        raise TimeoutError("nats-server did not write its ports file")


def start_etcd(tmp_dir: Path) -> EtcdProc:
    """Start a fresh etcd in `tmp_dir`; raises FileNotFoundError when the binary is missing."""
    proc = EtcdProc(tmp_dir)
    proc._spawn()
    return proc


def start_nats(tmp_dir: Path, jetstream: bool = False) -> NatsProc:
    """Start nats-server in `tmp_dir`; raises FileNotFoundError when the binary is missing."""
    proc = NatsProc(tmp_dir, jetstream=jetstream)
    proc._spawn()
    return proc
