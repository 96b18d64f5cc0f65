"""`dyngraph run in=http --http-processes N`: N frontend processes on one port, kept running.

The process given the flag serves nothing itself: it starts N copies of its own command line,
each a member of one group (`DYN_FRONTEND_GROUP`), so each binds the port beside the others
(SO_REUSEPORT) and answers /metrics for all of them (frontend/group.py). One that exits is
started again after a backoff while the others serve; one that keeps exiting at once stops the
group, and one that exits with CONFIG_EXIT (a taken port, a bad flag: a restart would fail the
same way) stops it at once, with that code. SIGINT or SIGTERM is passed on as SIGTERM, and the group
exits once every process finished its streams (each has its own grace, DYN_SHUTDOWN_GRACE_S);
if it is killed outright, its processes get SIGTERM from the kernel (Linux's parent-death signal).

A graph's frontend with `replicas: N` gets the same processes from the supervisor instead, one
process spec each (graph/compile.py), so `dyngraph status` lists them and rollouts replace them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys

from rich.console import Console

from dynamo_graph.backend.command_line import CONFIG_EXIT
from dynamo_graph.frontend.settings import GROUP_ENV
from dynamo_graph.process.run_config import RunConfig

log = logging.getLogger(__name__)
console = Console(stderr=True, soft_wrap=True)

BACKOFF_S = 1.0  # before the first restart of a process; doubles while it keeps exiting soon
BACKOFF_MAX_S = 30.0
SOON_S = 10.0  # an exit this soon after the start counts as "at once"
GIVE_UP_AFTER = 5  # exits at once in a row, of one process, that stop the group


PR_SET_PDEATHSIG = 1  # prctl(2)


def _end_with_parent() -> None:
    """In each child before it runs: SIGTERM when the group's process dies, by kill -9 too, so
    no orphan keeps the port (Linux; elsewhere an orphan serves on until stopped)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class _Group:
    def __init__(self, cfg: RunConfig) -> None:
        self.size = cfg.http.processes
        self.argv = [sys.executable, "-m", "dynamo_graph", *sys.argv[1:]]
        self.env = {**os.environ, GROUP_ENV: f"http-{cfg.http.port}-{os.getpid()}"}
        self.stopping = asyncio.Event()
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.failed = False

    async def keep(self, index: int) -> int:
        """Run process `index` until the group stops; its last exit code."""
        loop = asyncio.get_running_loop()
        backoff, soon = BACKOFF_S, 0
        while True:
            started = loop.time()
            proc = self.procs[index] = await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, preexec_fn=_end_with_parent
            )
            if self.stopping.is_set():  # the signal came while it was starting
                proc.send_signal(signal.SIGTERM)
            code = await proc.wait()
            if self.stopping.is_set():
                return code
            if code == CONFIG_EXIT:  # it said why on stderr
                self.stopping.set()
                return code
            ran = loop.time() - started
            soon = soon + 1 if ran < SOON_S else 0
            backoff = backoff if soon else BACKOFF_S
            if soon >= GIVE_UP_AFTER:
                log.error("frontend process %d failed %d times at once (exit %d): stop", index, soon, code)
                self.failed = True
                self.stopping.set()
                return code or 1
            log.warning(
                "frontend process %d (pid %d) exited with %d after %.1f s; restarting in %g s",
                index,
                proc.pid,
                code,
                ran,
                backoff,
            )
            try:
                await asyncio.wait_for(self.stopping.wait(), backoff)
                return code
            except TimeoutError:
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def stop_on_signal(self) -> None:
        await self.stopping.wait()
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        forward = asyncio.create_task(self.stop_on_signal())
        codes = await asyncio.gather(*(self.keep(i) for i in range(self.size)))
        self.stopping.set()
        await forward
        return 1 if self.failed else max((c for c in codes if c > 0), default=0)


def run_group(cfg: RunConfig) -> int:
    """Serve `cfg`'s frontend as `cfg.http.processes` processes on its port (see the module docstring)."""
    console.print(
        f"[bold green]dyngraph[/] starting {cfg.http.processes} frontend processes on "
        f"http://{cfg.http.host}:{cfg.http.port} (one that exits is restarted)"
    )
    return asyncio.run(_Group(cfg).run())
