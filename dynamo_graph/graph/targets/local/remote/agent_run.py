"""The `run` and `attach` commands of the agent (agent.py): one process of the plan on this host,
watched over the ssh channel the supervisor started it on, or re-attached to over a new one.

`run` reads the process (argv, env, workdir) as one JSON line on stdin, so no value of the env
(a token, a key) is ever on a command line where `ps` would show it. The process runs in a new
session (its own process group); its stdout and stderr go through the agent to the agent's
stdout, which ssh carries back into the supervisor's per-process log. The agent reports on
stderr, one line each: `pid PID START_TICKS` once started and `exit CODE` when it ended
(negative: killed by a signal).

The agent is the no-orphans watchdog: stdin stays open as long as the supervisor holds the ssh
channel, and the supervisor writes `ping` on it every few seconds. `term` on stdin stops the
process: SIGTERM to its group, SIGKILL after the grace, then SIGKILL to whatever is left in the
group. `signal NAME` (SIGKILL, SIGTERM or SIGINT) sends that signal to its group and nothing
else — a smoke test's fault: the exit is reported as any other, and the supervisor restarts the
process by its policy. Stdin closing (the supervisor died, the connection dropped, sshd's session child was
killed) or no line for three heartbeats (a network partition that neither end's TCP has noticed
yet) means the supervisor is gone: the process keeps running for `reattach_s` seconds, its output
kept (the last SPOOL_MAX bytes), waiting for the supervisor to come back over a new connection and
run `attach`, which passes that channel's stdin, stdout and stderr to this agent over a unix
socket only the user can open (SCM_RIGHTS). The agent then answers `pid ...` again on the new
channel, sends the output kept meanwhile, and goes on as before; a process that ended meanwhile
is reported (`exit CODE`) to the re-attached supervisor. Nobody back within `reattach_s`: the
process is stopped as for `term`. So a remote process never runs unsupervised for longer than
that. Should the agent itself be killed with SIGKILL, the process gets SIGKILL from the kernel
(PR_SET_PDEATHSIG); its own children in other sessions are then found by `scan --kill`, which
`dyngraph down` runs on every host: every process of a graph carries
`DYNGRAPH_PROC=<graph id>/<name>` in its environment.

A re-attach socket lives in `<temp dir>/dyngraph-agents-<uid>/<graph id>/`, folders only the user
can enter; the last agent of a graph on a host removes its folder, and `scan --kill` clears the
sockets of agents that were killed. The files a request carries (`files`: a process's TLS key
and certificates, which thus travel inside the ssh channel and never on a command line) are
written beside its socket, in `<socket>.<agent pid>.files/` (0700, files 0600; one per run, as a
rolling update runs the old and the new side by side), and removed when the process ends (or by
`scan --kill`, for an agent that was killed).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TAG_ENV = "DYNGRAPH_PROC"
SPOOL_MAX = 4 << 20  # output kept while no supervisor is attached (the newest bytes)
FAULT_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")  # what `signal NAME` may send
WRITE_TIMEOUT_S = 2.0  # a channel that takes no output for this long is treated as gone for that output
_PR_SET_PDEATHSIG = 1


def _sockets_root() -> Path:
    """A folder only this user can enter, in the temp dir (not XDG_RUNTIME_DIR, which logind
    removes with the user's last session: a cut connection may be that)."""
    return Path(tempfile.gettempdir()) / f"dyngraph-agents-{os.getuid()}"


def socket_path(tag: str) -> Path:
    """Where the `run` agent of process `tag` (`<graph id>/<name>`) waits for `attach`: one
    folder per graph, which `scan --kill` clears."""
    graph, _, name = tag.rpartition("/")
    return _sockets_root() / _safe(graph) / f"{hashlib.sha1(name.encode()).hexdigest()[:24]}.sock"


def _safe(graph: str) -> str:
    return graph if graph.replace("-", "").isalnum() else hashlib.sha1(graph.encode()).hexdigest()[:24]


def _private_folder(path: Path) -> None:
    """Make `path` (and its parents up to the sockets root) this user's alone, or raise."""
    for folder in (_sockets_root(), path):
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(f"{folder} is not this user's alone")


def _files_folder(tag: str, agent: int) -> Path:
    """Where the agent with pid `agent` keeps the files of process `tag`: one folder per run, as a
    rolling update runs a process's old and new run side by side."""
    sock = socket_path(tag)
    return sock.with_name(f"{sock.stem}.{agent}.files")


def write_files(tag: str, files: dict[str, str], agent: int) -> dict[str, str]:
    """Write a request's `files` (env variable -> contents) where only the user can read them;
    returns env variable -> path."""
    folder = _files_folder(tag, agent)
    _private_folder(folder.parent)
    folder.mkdir(mode=0o700, exist_ok=True)
    paths = {}
    for variable, text in files.items():
        path = folder / variable
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        paths[variable] = str(path)
    return paths


def _remove_files(folder: Path) -> None:
    for path in folder.glob("*"):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_sockets(prefix: str) -> None:
    """Remove the sockets of a graph's agents that are gone (nothing listens) and the files of
    those that are gone, and then its folder."""
    folder = socket_path(f"{prefix.rstrip('/')}/-").parent
    for files in folder.glob("*.files"):
        agent = files.name.rsplit(".", 2)[-2]
        if not agent.isdigit() or not _alive(int(agent)):
            _remove_files(files)
    for path in folder.glob("*.sock"):
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                path.unlink(missing_ok=True)
            except OSError:
                pass
    with contextlib.suppress(OSError):
        folder.rmdir()  # only when empty


class _Stdin:
    """Lines from one fd (the channel's stdin), unbuffered beyond what was read, with a timeout
    per line."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self._buffer = b""

    def line(self, timeout: float | None) -> bytes | None:
        """The next line; b"" at end of input, None when none came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # the channel is gone
                return b""
            if not chunk:
                return b""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"


def _die_with_agent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(
        _PR_SET_PDEATHSIG, signal.SIGKILL
    )  # the C library's, glibc or musl


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _start_ticks(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot; 0 when it is already gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _command(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "dynamo_graph", *argv[1:]] if argv[0] == "dyngraph" else argv


def _send(fd: int, data: bytes, timeout: float = WRITE_TIMEOUT_S) -> bytes:
    """Write `data` to a non-blocking fd; returns what could not be written (the fd is closed, or
    took nothing for `timeout` seconds: a stalled channel must not stall the agent)."""
    view = memoryview(data)
    while view:
        if not select.select([], [fd], [], timeout)[1]:
            break
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue
        except OSError:
            break
    return bytes(view)


class _Link:
    """One supervisor channel: control lines in (`ping`, `term`), output out, reports out."""

    def __init__(self, fds: tuple[int, int, int], conn: socket.socket | None = None) -> None:
        self.stdin = _Stdin(fds[0])
        self.out, self.ctl = fds[1], fds[2]
        self.fds = fds
        self.conn = conn  # the `attach` process's socket: it exits when this closes
        self.stalled = False  # output that did not go through: the rest waits for the next channel
        for fd in fds[1:]:
            os.set_blocking(fd, False)

    def report(self, line: str) -> bool:
        return not _send(self.ctl, (line + "\n").encode())

    def output(self, data: bytes) -> bytes:
        """Send process output; what did not go (nor will after it, to keep the order) is returned."""
        if not self.stalled:
            data = _send(self.out, data)
            self.stalled = bool(data)
        return data

    def close(self) -> None:
        """Let go of the channel, so that ssh ends it (stdio is pointed at /dev/null instead)."""
        null = os.open(os.devnull, os.O_RDWR)
        for fd in self.fds:
            if fd <= 2:
                os.dup2(null, fd)
            else:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.close(null)
        if self.conn is not None:
            self.conn.close()


class _Agent:
    """A started process and the channel the supervisor watches it over, which may be lost and
    re-attached (see the module docstring)."""

    def __init__(self, child: subprocess.Popen[bytes], spec: dict[str, Any]) -> None:
        self.child = child
        self.grace = float(spec["grace_s"])
        self.silence = 3 * spec["heartbeat_s"] if spec["heartbeat_s"] > 0 else None
        self.reattach_s = float(spec.get("reattach_s") or 0.0)
        self.cond = threading.Condition()
        self.link: _Link | None = _Link((0, 1, 2))
        self.spool = bytearray()
        self.dropped = 0
        self.gave_up = False  # nobody re-attached in time: the process was (or is being) stopped
        self.exit_code: int | None = None
        self.path = socket_path(spec["tag"])
        self.path_inode = 0
        self.listener = self._listen(self.path) if self.reattach_s > 0 else None

    def _listen(self, path: Path) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX)
        try:
            for attempt in range(3):  # the graph's last agent here may remove the folder meanwhile
                _private_folder(path.parent)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # a previous run of this process's agent
                try:
                    sock.bind(str(path))
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
            sock.listen(4)
            self.path_inode = path.stat().st_ino
            return sock
        except OSError as e:
            sock.close()
            print(f"dyngraph: no re-attaching to this process ({e}): it stops with its channel", flush=True)
            return None

    def relay(self, pipe: int) -> None:
        """The process's output to the channel; kept in the spool while there is none."""
        while chunk := os.read(pipe, 65536):
            with self.cond:
                self._keep(chunk if self.link is None else self.link.output(chunk))

    def _keep(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.spool += chunk
        if len(self.spool) > SPOOL_MAX:
            self.dropped += len(self.spool) - SPOOL_MAX
            del self.spool[: len(self.spool) - SPOOL_MAX]

    def watch(self) -> None:
        """Read the supervisor's lines; on `term`, or when it is gone and does not come back in
        time, stop the process."""
        while True:
            assert self.link is not None
            line = self.link.stdin.line(self.silence)
            words = line.split() if line else []  # None: silence past the heartbeats
            if words[:1] == [b"signal"] and len(words) == 2 and words[1].decode() in FAULT_SIGNALS:
                _killpg(self.child.pid, getattr(signal, words[1].decode()))
                continue
            if line and line.strip() != b"term":
                continue  # a ping
            if not line and self._wait_for_attach():
                continue
            self.stop()
            return

    def _wait_for_attach(self) -> bool:
        """The channel is gone: let go of it and wait up to `reattach_s` for `attach` (without
        re-attaching, keep it: its stderr may still carry the exit report)."""
        with self.cond:
            if self.exit_code is not None:
                return False  # the process has ended: `finish` reports that on this channel
            if self.link is not None and self.listener is not None:
                self.link.close()
                self.link = None
        deadline = time.monotonic() + self.reattach_s
        while self.listener is not None and (left := deadline - time.monotonic()) > 0:
            self.listener.settimeout(left)
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue  # timed out: the loop ends
            try:
                conn.settimeout(5.0)
                _, fds, _, _ = socket.recv_fds(conn, 16, 3)
            except OSError:
                fds = []
            if len(fds) != 3:  # a caller that sent no channel
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            with self.cond:
                self.link = _Link((fds[0], fds[1], fds[2]), conn)
                self.link.report(f"pid {self.child.pid} {_start_ticks(self.child.pid)}")
                self._flush_spool()
                self.cond.notify_all()
            return True
        with self.cond:
            self.gave_up = True
            self.cond.notify_all()
        return False

    def _flush_spool(self) -> None:
        assert self.link is not None
        if self.dropped:  # the oldest output went: say so before what is left
            self.spool[:0] = f"dyngraph: {self.dropped} bytes of output lost while detached\n".encode()
            self.dropped = 0
        rest = self.link.output(bytes(self.spool))
        self.spool[:] = rest

    def stop(self) -> None:
        _killpg(self.child.pid, signal.SIGTERM)
        try:
            self.child.wait(self.grace)
        except subprocess.TimeoutExpired:
            _killpg(self.child.pid, signal.SIGKILL)

    def finish(self, code: int, relay: threading.Thread) -> None:
        """Report the exit on the channel (waiting for a re-attach if there is none now)."""
        with self.cond:
            self.exit_code = code
        relay.join(5.0)  # its output first; the group is gone, so the pipe ends
        with self.cond:
            self.cond.wait_for(lambda: self.link is not None or self.gave_up or self.listener is None)
            if self.link is not None:
                self._flush_spool()
                self.link.report(f"exit {code}")
                self.link.close()
        if self.listener is not None:
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == self.path_inode:
                    self.path.unlink()  # ours, not a newer run's of the same process
                self.path.parent.rmdir()  # the graph's last one on this host
            self.listener.close()


def run() -> int:
    stdin = _Stdin()
    request = stdin.line(None)
    if not request:
        return 2  # the supervisor went away before saying what to run
    spec = json.loads(request)
    carried = write_files(spec["tag"], spec["files"], os.getpid()) if spec.get("files") else {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec["env"], **carried, TAG_ENV: spec["tag"]}
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            _command(spec["argv"]),
            cwd=os.path.expanduser(spec["workdir"]),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_agent,
        )
    except OSError as e:
        print(f"dyngraph: cannot start {spec['argv'][0]!r}: {e}", flush=True)
        sys.stderr.write("exit 127\n")
        return 0
    finally:
        os.close(write_end)
    agent = _Agent(child, spec)
    assert agent.link is not None
    agent.link.stdin = stdin  # what it read past the request line stays with it
    agent.link.report(f"pid {child.pid} {_start_ticks(child.pid)}")
    relay = threading.Thread(target=agent.relay, args=(read_end,), daemon=True)
    relay.start()
    threading.Thread(target=agent.watch, daemon=True).start()
    code = child.wait()
    _killpg(child.pid, signal.SIGKILL)  # what it left in its group; its pid is still the group's id
    if carried:
        _remove_files(_files_folder(spec["tag"], os.getpid()))
    agent.finish(code, relay)
    return 0


def attach(tag: str) -> int:
    """Give this channel to the agent of `tag` and stay until it lets go (ssh ends the channel
    when the last holder of its stdout closes it). `gone` on stderr: no agent waits for it."""
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(str(socket_path(tag)))
            socket.send_fds(sock, [b"attach"], [0, 1, 2])
        except OSError:
            sys.stderr.write("gone\n")
            return 3
        for fd in (0, 1, 2):  # the agent holds the channel now
            os.dup2(os.open(os.devnull, os.O_RDWR), fd)
        with contextlib.suppress(OSError):
            sock.recv(1)
    return 0
