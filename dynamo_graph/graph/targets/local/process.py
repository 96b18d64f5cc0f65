"""Run one ProcessSpec on this host, and stop it without ever signalling a stranger.

Each process gets its own session (so its group can be stopped as a whole, and a terminal's
Ctrl-C reaches only the supervisor), the graph's env on top of ours, and its log file for
stdout + stderr. A pid read back from a file is only trusted together with its start time from
/proc (`pid_alive`), because pids are reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from dynamo_graph.graph.plan import ProcessSpec

START_MARKER = "--- dyngraph: started "  # written to the log before each start (see LogWatch)


def pid_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    if fields[0] == "Z":
        return None  # a zombie has finished
    return int(fields[19])


def pid_alive(pid: int, start_ticks: int | None) -> bool:
    """True only for the very process that had this start time (not a later one with its pid)."""
    return start_ticks is not None and pid_start_ticks(pid) == start_ticks


def kill_verified(pid: int, start_ticks: int | None, sig: int) -> bool:
    """Signal the group of a process read back from a file, if it is still the one we started."""
    if not pid_alive(pid, start_ticks):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    return True


def mark_start(log_path: Path, name: str, attempt: int) -> int:
    """Write the start marker of a run to its log; returns where the run's output begins."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        now = time.time()  # UTC and milliseconds, so `dyngraph logs` can order it among the others
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        log.write(f"{START_MARKER}{name} (run {attempt}) at {stamp} ---\n".encode())
        return log.tell()


def command_line(spec: ProcessSpec, python: str | None = None) -> list[str]:
    """The argv to exec: the plan's leading `dyngraph` runs as a module of `python` (the plan's
    local interpreter), or of this interpreter."""
    if spec.argv[0] == "dyngraph":
        return [python or sys.executable, "-m", "dynamo_graph", *spec.argv[1:]]
    return list(spec.argv)


class LocalProcess:
    """One run of a spec: started by `start`, reaped by `wait`, stopped by `stop`."""

    def __init__(self, spec: ProcessSpec, log_path: Path, python: str | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self.python = python
        self.proc: asyncio.subprocess.Process | None = None
        self.log_offset = 0  # where this run's output starts in the log
        self.start_ticks: int | None = None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self, attempt: int) -> None:
        """Spawn; raises OSError (written to the log too) when the program cannot be run."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        self.log_offset = mark_start(self.log_path, self.spec.name, attempt)
        with self.log_path.open("ab") as log:
            self.started_at = time.time()
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *command_line(self.spec, self.python),
                    cwd=self.spec.workdir,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                log.write(f"dyngraph: cannot start {self.spec.argv[0]!r}: {e}\n".encode())
                raise
        self.start_ticks = pid_start_ticks(self.proc.pid)

    @staticmethod
    async def open_connection(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection as this host makes it (readiness probes)."""
        return await asyncio.open_connection(host, port)

    async def wait(self) -> int:
        """The exit code, once reaped and what it left in its group is swept."""
        assert self.proc is not None
        code = await self.proc.wait()
        self._signal_group(signal.SIGKILL)  # what it left in its group; its pid is not reused yet
        return code

    def send_signal(self, sig: signal.Signals) -> bool:
        """`sig` to the process's group (a smoke test's fault); False when it has ended."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        return kill_verified(self.proc.pid, self.start_ticks, sig)

    async def stop(self) -> int | None:
        """SIGTERM to the group, SIGKILL after the spec's grace; `wait` sweeps what is left."""
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc else None
        self._signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), self.spec.shutdown_grace_s)
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
        return await self.wait()

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
