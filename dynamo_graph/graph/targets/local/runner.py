"""One process of the plan across its restarts, and stopping a set of them in dependency order.

A `Runner` task per process: wait until everything in `depends_on` is ready, start, probe
until ready (or exit, or the probe's timeout), watch, and on exit restart with exponential
backoff (`backoff_s` doubling up to `backoff_max_s`; the streak resets once a run stayed up
`STABLE_AFTER_S`). More than `max_restarts` failures in a row is a crash loop: the process is
left `failed` and its last log lines are reported. A `dyngraph run` that exits with CONFIG_EXIT
and was never ready (an engine that raises at import, a model that does not load, bad settings)
would fail the same way again: it is left `failed` at once, not retried through the backoff; one
that served before and fails so on a restart (a model hub out of reach meanwhile) is retried as
any crash. A rollout's new run is `proving`: it gets one try, and not being ready ends it (rollout.py then
rolls back instead of restarting it).

The ranks of a replica over several nodes are one group: one that ends takes the others'
runs down with it, and all restart (gang.py).

Processes on remote hosts run through the ssh launcher (ssh.py); runners treat its processes
exactly as local ones, but for one more state: `reconnecting` while the connection to their
host is lost and the launcher tries to re-attach to the process, which runs on meanwhile.
Re-attached, it is the same run (no restart counted); if it ended meanwhile or could not be
re-attached, that is its exit, as for any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import msgspec

from dynamo_graph.backend.command_line import CONFIG_EXIT
from dynamo_graph.graph.plan import ProcessSpec
from dynamo_graph.graph.targets.local import gang, probes
from dynamo_graph.graph.targets.local.logs import tail_lines
from dynamo_graph.graph.targets.local.process import LocalProcess
from dynamo_graph.graph.targets.local.state import ProcessRecord, StateDir
from dynamo_graph.runtime.traffic import LABELS_ENV

if TYPE_CHECKING:
    from dynamo_graph.graph.targets.local.remote.ssh import RemoteProcess

Report = Callable[[str, str], None]  # (process name, message)


class Fleet(Protocol):
    """What a runner needs of the supervisor that holds it (supervisor.py)."""

    state: StateDir
    report: Report
    runners: dict[str, Runner]

    def launcher(self, spec: ProcessSpec) -> LocalProcess | RemoteProcess: ...

    def persist(self) -> None: ...


STABLE_AFTER_S = 10.0
CRASH_LOG_LINES = 20
PROBE_MAX_INTERVAL_S = 0.05  # probes start at 10 ms and back off to this


class Runner:
    """The life of one process of the plan, across its restarts."""

    def __init__(self, sup: Fleet, spec: ProcessSpec, revision: int = 0, proving: bool = False) -> None:
        self.sup = sup
        self.spec = spec
        # A proving runner (a rollout's new run) gets one try: if it is not ready, the rollout
        # rolls back instead of restarting it.
        self.proving = proving
        self.record = ProcessRecord(spec.name, spec.component, spec.replica, spec.host, revision=revision)
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()
        self.blocked_by: str | None = None  # the dependency that gave up, so this never started
        self.proc: LocalProcess | RemoteProcess | None = None
        # The current run was stopped because another rank of its group ended (gang.py).
        self.taken_down = False
        self._start: asyncio.Future[None] | None = None
        self._task = asyncio.create_task(self._run(), name=f"runner {spec.name}")

    def _set(self, **changes: object) -> None:
        for key, value in changes.items():
            setattr(self.record, key, value)
        self.sup.persist()

    async def _run(self) -> None:
        streak = 0
        runs = 0
        served = False  # some run of this process was ready: a later start-up error may pass
        while True:
            gave_up = await self._wait_dependencies()
            if gave_up is not None:
                self.blocked_by = gave_up
                self._set(state="failed", pid=None, message=f"dependency {gave_up} failed")
                self.sup.report(self.spec.name, f"not started: its dependency {gave_up} failed")
                return
            runs += 1
            code, failed = await self._one_run(runs)
            served = served or self.ready.is_set()
            self.ready.clear()
            assert self.proc is not None
            if self.taken_down:
                self.taken_down, failed = False, True
            elif self.spec.group and (peers := gang.take_down_peers(self, self.sup.runners.values())):
                self.sup.report(self.spec.name, f"its group goes down with it: stopping {', '.join(peers)}")
            if self.proving:
                why = self.record.message or f"exited with {code} before it was ready"
                self._set(state="failed", pid=None, message=why)
                self.sup.report(self.spec.name, f"new run failed: {why}")
                return
            if not served and code == CONFIG_EXIT and self.spec.argv[0] == "dyngraph":
                why = f"exited with {code} before it was ready: a start-up error a restart would repeat"
                self._give_up(code, why)
                return
            if time.time() - self.proc.started_at >= STABLE_AFTER_S:
                streak = 0
            policy = self.spec.restart
            if policy.policy == "never" or (policy.policy == "on-failure" and not failed):
                self._set(state="failed" if failed else "exited", pid=None)
                self.sup.report(self.spec.name, f"exited with {code}; restart policy {policy.policy}")
                return
            streak += 1
            if streak > policy.max_restarts:
                self._give_up(code, f"crash loop: failed {streak} times in a row (last exit {code})")
                return
            delay = min(policy.backoff_s * 2 ** (streak - 1), policy.backoff_max_s)
            self._set(state="restarting", pid=None, restarts=self.record.restarts + 1)
            self.sup.report(self.spec.name, f"exited with {code}; restarting in {delay:g} s")
            await asyncio.sleep(delay)

    def _give_up(self, code: int, why: str) -> None:
        """Leave the process `failed` and report why, with its last log lines."""
        self._set(state="failed", pid=None, message=why)
        tail = "\n".join(tail_lines(self.sup.state.log_file(self.spec.name), CRASH_LOG_LINES))
        self.sup.report(self.spec.name, f"{why}, giving up; last log lines:\n{tail}")

    async def _wait_dependencies(self) -> str | None:
        """Wait until every dependency is ready; returns the name of one that gave up for good
        (its runner ended without being ready), since waiting for it would be forever."""
        while True:
            deps = [self.sup.runners[d] for d in self.spec.depends_on if d in self.sup.runners]
            for dep in deps:
                if dep._task.done() and not dep.ready.is_set():
                    return dep.spec.name
            pending = [d for d in deps if not d.ready.is_set()]
            if not pending:
                return None
            ready = asyncio.ensure_future(pending[0].ready.wait())
            try:
                await asyncio.wait({ready, pending[0]._task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()

    async def _one_run(self, attempt: int) -> tuple[int, bool]:
        """Start, probe, watch one run; returns (exit code, whether it counts as a failure)."""
        self.proc = self.sup.launcher(_labelled(self.spec, self.record.revision))
        if not isinstance(self.proc, LocalProcess):
            self.proc.on_link = self._link_changed
        self._start = asyncio.ensure_future(self.proc.start(attempt))
        try:
            await asyncio.shield(self._start)
        except OSError as e:
            self._set(message=f"cannot start: {e}")
            return 127, True
        proc = self.proc
        self._set(
            state="starting",
            pid=proc.pid,
            start_ticks=proc.start_ticks,
            started_at=proc.started_at,
            message="",
        )
        exited = asyncio.ensure_future(proc.wait())
        if await self._probe_until_ready(proc, exited):
            self.proving = False
            self._set(state="ready")
            self.ready.set()
            elapsed = time.time() - proc.started_at
            self.sup.report(self.spec.name, f"ready in {elapsed:.2f} s (pid {proc.pid})")
        elif not exited.done():
            timeout = self.spec.readiness.timeout_s
            self._set(message=f"not ready after {timeout:g} s")
            self.sup.report(self.spec.name, f"not ready after {timeout:g} s; stopping it")
            await proc.stop()
        code = await exited
        self._set(last_exit=code)
        return code, code != 0 or not self.ready.is_set()

    async def proven(self) -> bool:
        """Wait until this run is ready (True) or its runner gave up (False)."""
        ready = asyncio.ensure_future(self.ready.wait())
        try:
            await asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        return self.ready.is_set()

    def _link_changed(self, attached: bool, why: str) -> None:
        """A remote process's connection was lost (it runs on, unwatched) or it was re-adopted over
        a new one: the same run, so no restart is counted."""
        if attached:
            self._set(state="ready" if self.ready.is_set() else "starting", message="")
            pid = self.proc.pid if self.proc else None
            self.sup.report(self.spec.name, f"re-attached over a new connection (pid {pid}), not restarted")
        else:
            self._set(state="reconnecting", message=why)
            self.sup.report(self.spec.name, why)

    async def _probe_until_ready(
        self, proc: LocalProcess | RemoteProcess, exited: asyncio.Future[int]
    ) -> bool:
        probe = self.spec.readiness
        watch = probes.LogWatch(proc.log_path, proc.log_offset)
        deadline = time.monotonic() + probe.timeout_s
        delay = 0.01
        while time.monotonic() < deadline and not exited.done():
            if await probes.check(probe, watch, proc.open_connection, proc.pid):
                return True
            await asyncio.wait([exited], timeout=delay)
            delay = min(delay * 1.5, PROBE_MAX_INTERVAL_S)
        return False

    async def stop(self) -> None:
        """Stop for good: cancel the lifecycle, then SIGTERM/SIGKILL the current run."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._start is not None:
            with contextlib.suppress(OSError):
                await self._start
        code = await self.proc.stop() if self.proc else None
        self.ready.clear()
        if self.record.state not in ("failed", "exited"):
            self._set(state="stopped", pid=None, last_exit=code)
        self.stopped.set()


async def stop_in_order(runners: Iterable[Runner]) -> None:
    """Stop runners concurrently, each only after the runners that depend on it have stopped."""
    runners = list(runners)
    names = {r.spec.name for r in runners}
    dependents = {n: [r for r in runners if n in r.spec.depends_on] for n in names}

    async def stop_one(runner: Runner) -> None:
        for dependent in dependents[runner.spec.name]:
            await dependent.stopped.wait()
        await runner.stop()

    await asyncio.gather(*(stop_one(r) for r in runners))


def _labelled(spec: ProcessSpec, revision: int) -> ProcessSpec:
    """The spec a run launches with: its instances labelled with the run's revision, which a
    canary's traffic split selects by (canary.py). Added at launch, not in the plan, so a new
    revision does not make every unchanged process look changed."""
    labels = ",".join(filter(None, (spec.env.get(LABELS_ENV, ""), f"revision={revision}")))
    return msgspec.structs.replace(spec, env={**spec.env, LABELS_ENV: labels})
