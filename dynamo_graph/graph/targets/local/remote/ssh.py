"""Run processes of the plan on remote hosts over ssh, behind the same interface as process.py.

The client is asyncssh rather than the system `ssh` with ControlMaster: the supervisor is an
asyncio program, and asyncssh gives it, in-process, one connection per host carrying one
channel per process (stdin, stdout and stderr apart, exit status), connection-loss callbacks
and keepalives, host-key checking against known_hosts files or keys pinned in the graph, and
typed errors (`HostKeyNotVerifiable`, `PermissionDenied`) that become clear messages. The
OpenSSH route would mean a ssh child per process, a control socket per host to babysit, and
parsing its stderr to tell a refused key from a dead network. asyncssh reads the user's
`~/.ssh/config` and agent as `ssh` does; `render -f shell` still prints plain `ssh` commands.

Each remote process is the agent (agent.py) started over one channel: it gets the process's
spec as a JSON line on stdin (so env values never reach a command line) with the contents of the
files it needs there (`ProcessSpec.carry`: its TLS key and certificates), answers `pid ...`,
streams the output, which is appended here to the same per-process log as a local process's,
and ends with `exit CODE`. The agent is the watchdog against orphans: when the channel closes
(supervisor gone, connection cut) or the supervisor's heartbeat on it stops (a partition), it
keeps its process running for agent.REATTACH_S, waiting to be re-attached, and then stops it.
A dropped connection ends every channel on it: each RemoteProcess then reports its process
`reconnecting` (status shows it) and reconnects, with backoff, and runs `agent attach` over a
new channel. A process still running is re-adopted: the same pid, the output it wrote meanwhile
appended to its log, no restart counted. One that ended meanwhile is reported with its exit
code, and one whose agent is gone (not back in time: it stopped it) as LOST (255, as `ssh`
reports a lost connection); the runner applies the restart policy to both. Only the supervisor
that started a process re-attaches it: a new supervisor starts fresh ones (the old ones stop
when nobody re-attaches them).

Readiness probes of a remote process connect from its host, through the ssh connection, and
`auto` ports of a process on a remote host are ports free there (the agent's `ports`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from dynamo_graph.graph.plan import LOCAL, Plan, ProcessSpec, RemoteHost
from dynamo_graph.graph.targets.local.process import mark_start
from dynamo_graph.graph.targets.local.remote import agent

CONNECT_TIMEOUT_S = 10.0
RECONNECT_TRIES = 5  # the runner's restart policy retries on a longer scale
RECONNECT_BACKOFF_S = (0.2, 3.0)  # first delay, ceiling; doubling in between
KEEPALIVE_S = 2.0  # a silent connection is declared dead after 3 missed keepalives
AGENT_START_TIMEOUT_S = 30.0
AGENT_RUN_TIMEOUT_S = 60.0  # probe may wait on nvidia-smi; scan --kill gets its grace on top
LOST = 255  # exit code of a process whose connection was lost (what `ssh` exits with)
REATTACH_MARGIN_S = 5.0  # tries to re-attach go on this much longer than the agent waits


class SshError(OSError):
    """A host could not be reached, refused us, or the agent could not start there."""


class Unreachable(SshError):
    """No ssh connection could be made (network, sshd down): worth trying again."""


class HostKeyRefused(SshError):
    """The host's key is not the one known_hosts or the graph pins: never retried, never accepted."""


class AuthRefused(SshError):
    """The host did not accept the login."""


@dataclass(frozen=True)
class Completed:
    """What a finished agent command left: its exit status (None: killed) and its output."""

    exit_status: int | None
    stdout: str
    stderr: str


def _known_hosts(host: RemoteHost) -> object:
    if host.host_key is not None:
        return ([asyncssh.import_public_key(host.host_key)], [], [])
    return host.known_hosts if host.known_hosts is not None else ()  # () = the client's default files


def describe(key: str, host: RemoteHost) -> str:
    user = f"{host.user}@" if host.user else ""
    return f"host {key!r} ({user}{host.address}:{host.port})"


async def connect(key: str, host: RemoteHost) -> asyncssh.SSHClientConnection:
    """One verified connection; SshError says what went wrong in words a user can act on."""
    where = describe(key, host)
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            return await asyncssh.connect(
                host.address,
                port=host.port,
                username=host.user or (),  # () = the client's default, as ssh(1) does; None breaks asyncssh
                client_keys=[host.identity_file] if host.identity_file else (),
                known_hosts=_known_hosts(host),
                keepalive_interval=KEEPALIVE_S,
                keepalive_count_max=3,
            )
    except asyncssh.HostKeyNotVerifiable:
        if host.host_key:
            why = "it does not match the key pinned in ssh.host_key"
        else:
            listing = host.known_hosts or "the ssh client's known_hosts files"
            why = f"it is not listed in {listing} (an unknown host, or its key changed)"
        raise HostKeyRefused(
            f"{where}: host key refused: {why}; if the host was reinstalled, check its new key and "
            "update the graph or known_hosts"
        ) from None
    except asyncssh.PermissionDenied as e:
        raise AuthRefused(f"{where}: authentication refused ({e.reason})") from None
    except (OSError, asyncssh.Error, TimeoutError) as e:
        raise Unreachable(f"{where}: unreachable ({e or type(e).__name__})") from None


class SshHosts:
    """The connections of one supervisor: one per host, opened on first use and reused;
    reopened with backoff once it dropped. sshd caps the sessions of one connection (OpenSSH's
    MaxSessions, 10 by default): a host that refuses one more gets a further connection."""

    def __init__(self, hosts: dict[str, RemoteHost], *, tries: int = RECONNECT_TRIES) -> None:
        self.hosts = hosts
        self.tries = tries  # connection attempts to an unreachable host before giving up
        self._conns: dict[str, list[asyncssh.SSHClientConnection]] = {}  # oldest first
        self._locks: dict[str, asyncio.Lock] = {}

    def update(self, hosts: dict[str, RemoteHost]) -> None:
        """Take a new plan's hosts; a host whose connection settings changed is reconnected."""
        for key, host in hosts.items():
            if self.hosts.get(key, host) != host:
                for conn in self._conns.pop(key, []):
                    conn.close()
        self.hosts.update(hosts)

    async def connection(
        self, key: str, *, full: asyncssh.SSHClientConnection | None = None
    ) -> asyncssh.SSHClientConnection:
        """The host's newest live connection, or a new one when there is none or the newest is
        `full` (it refused a session)."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            live = self._conns[key] = [c for c in self._conns.get(key, []) if not c.is_closed()]
            if live and live[-1] is not full:
                return live[-1]
            delay = RECONNECT_BACKOFF_S[0]
            for attempt in range(self.tries):
                try:
                    conn = await connect(key, self.hosts[key])
                    live.append(conn)
                    return conn
                except Unreachable:  # a refused key or login does not get better by retrying
                    if attempt == self.tries - 1:
                        raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_BACKOFF_S[1])
            raise AssertionError("unreachable: the loop returns or raises")

    async def session(self, key: str, command: str) -> asyncssh.SSHClientProcess[bytes]:
        """A new channel running `command` on host `key` (bytes in and out)."""
        conn = await self.connection(key)
        try:
            return await conn.create_process(command, encoding=None)
        except asyncssh.ChannelOpenError:  # the connection has sshd's MaxSessions: one more
            conn = await self.connection(key, full=conn)
            return await conn.create_process(command, encoding=None)

    async def run(self, key: str, *args: str, stdin: str = "", extra_s: float = 0.0) -> Completed:
        """Run the agent with `args` on host `key` and collect its output (given AGENT_RUN_TIMEOUT_S
        plus `extra_s`)."""
        try:
            async with asyncio.timeout(AGENT_RUN_TIMEOUT_S + extra_s):
                proc = await self.session(key, agent.command(self.hosts[key].python, *args))
                out, err = await proc.communicate(stdin.encode())
                await proc.wait_closed()
        except SshError:
            raise
        except (OSError, asyncssh.Error, TimeoutError) as e:
            raise SshError(f"{describe(key, self.hosts[key])}: {e or type(e).__name__}") from None
        return Completed(
            proc.exit_status,
            bytes(out or b"").decode(errors="replace"),
            bytes(err or b"").decode(errors="replace"),
        )

    async def allocate_ports(self, plan: Plan, ports: dict[str, int]) -> None:
        """Give each `auto` port that a process on a remote host declares a port free on that
        host, into `ports` (port name -> port; names already there keep theirs)."""
        wanted: dict[str, list[str]] = {}
        for spec in plan.processes:
            if spec.host != LOCAL:
                names = [n for n, p in spec.ports.items() if p == "auto" and n not in ports]
                wanted.setdefault(spec.host, []).extend(names)
        for host, names in wanted.items():
            if not names:
                continue
            held = [str(p) for s in plan.processes if s.host == host for n in s.ports if (p := ports.get(n))]
            done = await self.run(host, "ports", str(len(names)), *held)
            if done.exit_status != 0:
                raise SshError(
                    f"{describe(host, self.hosts[host])}: no free ports: {done.stderr.strip()[-300:]}"
                )
            ports.update(zip(names, json.loads(last_line(done.stdout)), strict=True))

    async def close(self) -> None:
        conns = [c for host in self._conns.values() for c in host]
        self._conns = {}
        for conn in conns:
            conn.close()
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.wait_closed()


class RemoteProcess:
    """One run of a spec on a remote host through the agent; the same interface as LocalProcess
    (`pid` and `start_ticks` are the remote process's)."""

    def __init__(self, spec: ProcessSpec, log_path: Path, hosts: SshHosts, tag: str) -> None:
        self.spec = spec
        self.log_path = log_path
        self.hosts = hosts
        self.tag = tag
        self.log_offset = 0
        self.pid: int | None = None
        self.start_ticks: int | None = None
        self.started_at = 0.0
        self._proc: asyncssh.SSHClientProcess[bytes] | None = None
        self._done: asyncio.Future[int] | None = None
        self._stopping = False
        # Told when the connection is lost (False) and when the process is re-attached (True).
        self.on_link: Callable[[bool, str], None] = lambda attached, why: None

    def _log(self, text: str) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"dyngraph: {text}\n".encode())

    async def start(self, attempt: int) -> None:
        """Start the agent and the process; raises SshError (an OSError, written to the log too)."""
        self.log_offset = mark_start(self.log_path, self.spec.name, attempt)
        self.started_at = time.time()
        host = self.hosts.hosts[self.spec.host]
        try:
            proc = self._proc = await self.hosts.session(self.spec.host, agent.command(host.python, "run"))
            s, tag = self.spec, f"{self.tag}/{self.spec.name}"
            request = agent.run_request(
                s.argv,
                s.env,
                s.workdir,
                tag,
                s.shutdown_grace_s,
                agent.HEARTBEAT_S,
                agent.REATTACH_S,
                _carried(s),
            )
            proc.stdin.write(request.encode())
            async with asyncio.timeout(AGENT_START_TIMEOUT_S):
                words, noise = await _pid_line(proc.stderr)
        except (OSError, asyncssh.Error, TimeoutError) as e:
            error = e if isinstance(e, SshError) else SshError(f"{describe(self.spec.host, host)}: {e!r}")
            self._log(str(error))
            self._close()
            raise error from None
        if not words:  # the agent (or the python it needs) did not run: what it said is the reason
            why = noise.decode(errors="replace").strip()[-2000:] or f"exit {proc.exit_status}"
            self._log(f"the agent did not start on {describe(self.spec.host, host)}: {why}")
            self._close()
            raise SshError(f"the agent did not start on {describe(self.spec.host, host)}: {why}")
        if noise.strip():
            self._log(f"agent: {noise.decode(errors='replace').rstrip()}")  # e.g. a login script's warnings
        self.pid, self.start_ticks = int(words[1]), int(words[2])
        heartbeat = asyncio.ensure_future(self._ping(proc))
        self._done = asyncio.ensure_future(self._watch(proc, heartbeat))

    async def open_connection(
        self, host: str, port: int
    ) -> tuple[asyncssh.SSHReader[bytes], asyncssh.SSHWriter[bytes]]:
        """A TCP connection made from the remote host, through the ssh connection (readiness
        probes: `127.0.0.1` is the host's own loopback). Needs the host's sshd to allow TCP
        forwarding (OpenSSH's default)."""
        try:
            conn = await self.hosts.connection(self.spec.host)
            return await conn.open_connection(host, port, encoding=None)
        except asyncssh.Error as e:
            raise OSError(f"{host}:{port} from {self.spec.host}: {e.reason}") from None

    async def _ping(self, proc: asyncssh.SSHClientProcess[bytes]) -> None:
        """Tell the agent the supervisor is still there (its watchdog's heartbeat)."""
        with contextlib.suppress(OSError, asyncssh.Error):
            while True:
                await asyncio.sleep(agent.HEARTBEAT_S)
                proc.stdin.write(b"ping\n")

    async def _watch(self, proc: asyncssh.SSHClientProcess[bytes], heartbeat: asyncio.Future[None]) -> int:
        while True:
            output = asyncio.ensure_future(self._copy_output(proc))
            code = await self._read_exit(proc)
            heartbeat.cancel()
            if code != LOST:
                await output
                return code
            where = describe(self.spec.host, self.hosts.hosts[self.spec.host])
            self._log(f"connection to {where} lost; re-attaching")
            self._close()  # the remote agent sees its channel close and waits to be re-attached
            await output
            self.on_link(False, f"connection to {where} lost; re-attaching")
            again = await self._reattach()
            if again is None:
                self._log(f"could not re-attach on {where}: the agent has stopped the process")
                return LOST
            self._log(f"re-attached on {where} (pid {self.pid})")
            self.on_link(True, "")
            proc = self._proc = again
            heartbeat = asyncio.ensure_future(self._ping(proc))

    async def _reattach(self) -> asyncssh.SSHClientProcess[bytes] | None:
        """A new channel to this process's agent, over a new connection when needed; None once
        the agent says it is gone or the time it waits has passed."""
        host = self.hosts.hosts[self.spec.host]
        command = agent.command(host.python, "attach", f"{self.tag}/{self.spec.name}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + agent.REATTACH_S + REATTACH_MARGIN_S
        delay = RECONNECT_BACKOFF_S[0]
        while (left := deadline - loop.time()) > 0:
            proc = None
            try:
                async with asyncio.timeout(left):
                    proc = await self.hosts.session(self.spec.host, command)
                    words, _ = await _pid_line(proc.stderr)
            except (OSError, asyncssh.Error, TimeoutError):
                if proc is not None:
                    proc.close()
                await asyncio.sleep(min(delay, max(deadline - loop.time(), 0)))
                delay = min(delay * 2, RECONNECT_BACKOFF_S[1])
                continue
            if words and int(words[1]) == self.pid:
                if self._stopping:  # `stop` came while the connection was down
                    proc.stdin.write(b"term\n")
                return proc
            proc.close()  # `gone`: nobody waits for this process any more
            return None
        return None

    async def _copy_output(self, proc: asyncssh.SSHClientProcess[bytes]) -> None:
        with self.log_path.open("ab") as log, contextlib.suppress(OSError, asyncssh.Error):
            while chunk := await proc.stdout.read(65536):
                log.write(chunk)
                log.flush()

    async def _read_exit(self, proc: asyncssh.SSHClientProcess[bytes]) -> int:
        with contextlib.suppress(OSError, asyncssh.Error):
            while line := await proc.stderr.readline():
                words = line.decode(errors="replace").split()
                if words[:1] == ["exit"] and len(words) == 2:
                    return int(words[1])
                self._log(f"agent: {line.decode(errors='replace').rstrip()}")  # e.g. its own traceback
        return LOST

    async def wait(self) -> int:
        """The process's exit code once the agent reported it (it swept the group first), or
        LOST when the connection went first."""
        assert self._done is not None
        return await asyncio.shield(self._done)

    def send_signal(self, sig: signal.Signals) -> bool:
        """Ask the agent to send `sig` to the process's group (a smoke test's fault); False when
        there is no channel to ask on now."""
        if self._proc is None or self._done is None or self._done.done():
            return False
        try:
            self._proc.stdin.write(f"signal {sig.name}\n".encode())
        except (OSError, asyncssh.Error):
            return False
        return True

    async def stop(self) -> int | None:
        """`term` to the agent (SIGTERM, grace, SIGKILL on the host); if the connection is gone
        the agent's watchdog has done it already."""
        if self._done is None:
            return None
        self._stopping = True
        if not self._done.done():
            assert self._proc is not None
            with contextlib.suppress(OSError, asyncssh.Error):
                self._proc.stdin.write(b"term\n")
            # Reconnecting: a re-attach sends `term`; else the agent stops it once it stops waiting.
            wait = self.spec.shutdown_grace_s + 10.0 + agent.REATTACH_S + REATTACH_MARGIN_S
            done, _ = await asyncio.wait([self._done], timeout=wait)
            if not done:
                self._close()
        return await self.wait()

    def _close(self) -> None:
        if self._proc is not None:
            self._proc.close()


def _carried(spec: ProcessSpec) -> dict[str, str]:
    """The contents of the files the process needs on its host (its TLS key and certificates):
    they go over the channel, never on a command line."""
    return {var: Path(spec.env[var]).read_text() for var in spec.carry}


async def _pid_line(stderr: asyncssh.SSHReader[bytes]) -> tuple[list[str], bytes]:
    """The agent's `pid PID TICKS` words (empty when stderr ended first), and what came before."""
    noise = b""
    while line := await stderr.readline():
        words = line.decode(errors="replace").split()
        if words[:1] == ["pid"] and len(words) == 3:
            return words, noise
        noise += line
    return [], noise


def last_line(stdout: str) -> str:
    """The agent's answer: its last line of output (a login script may print before it)."""
    lines = stdout.strip().splitlines()
    return lines[-1] if lines else ""


async def sweep_hosts(
    hosts: dict[str, RemoteHost], state_root: Path, grace: float
) -> tuple[list[str], list[str]]:
    """On every host: stop the graph's processes still there (SIGTERM, grace, SIGKILL). Returns
    those that would not stop (`name on host (pid N)`) and the hosts that could not be asked."""
    pool = SshHosts(dict(hosts))
    tag = agent.graph_tag(state_root)
    left: list[str] = []
    unchecked: list[str] = []

    async def one(key: str) -> None:
        try:
            done = await pool.run(key, "scan", f"{tag}/", "--kill", f"{grace:g}", extra_s=grace)
        except SshError as e:
            unchecked.append(str(e))
            return
        if done.exit_status != 0:
            unchecked.append(f"{describe(key, hosts[key])}: {done.stderr.strip()[-300:]}")
            return
        found: dict[str, str] = json.loads(last_line(done.stdout))
        left.extend(f"{proc.rpartition('/')[2]} on {key} (pid {pid})" for pid, proc in found.items())

    try:
        await asyncio.gather(*(one(k) for k in sorted(hosts)))
    finally:
        await pool.close()
    return left, unchecked
