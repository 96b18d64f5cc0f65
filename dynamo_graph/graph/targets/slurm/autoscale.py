"""The planner of a graph that runs as a Slurm job: the local autoscaler (local/planner.py) in
a process of the job's batch step, acting on the job's steps instead of a supervisor's runners.

The job holds an autoscaled pool's `max_replicas` from the start (script.py): the replicas
beyond `replicas` are steps that wait while their `steps/<name>.off` exists. To grow, the
planner removes a standby replica's `.off`, and the pool counts it once its step is ready and
every serving frontend lists its instance; one that fails to get there gets its `.off` back and
is stopped, and the pool keeps what it had. To shrink, it writes the newest replica's `.off`,
then SIGTERM to that step alone: the worker leaves discovery and finishes its streams within
its grace, as a rollout retires one (no request lost), and `run_step` does not restart it. A
replica still running after its grace is killed.

The planner measures what the frontends count, as the local one does: their /health, asked
from the first node. Decisions go to the state dir's `autoscale.jsonl` / `autoscale.json`,
which `status` shows with the replicas each pool runs. It takes the state dir's lock for a
change, so a change never overlaps `up` rolling the job; it ends with the batch step.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dynamo_graph.graph.plan import AutoscalePolicy, Plan, ProcessSpec
from dynamo_graph.graph.targets.local.answers import INSTANCE_LINE, Answers, health_at, tally
from dynamo_graph.graph.targets.local.planner import Autoscaler, Member
from dynamo_graph.graph.targets.local.process import START_MARKER
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.slurm import job
from dynamo_graph.graph.targets.slurm.job import SlurmError, SlurmState
from dynamo_graph.graph.targets.slurm.script import fill_plan, fill_text, node_order, probe_target

POLL_S = 0.2
STOP_MARGIN_S = 15.0  # past a replica's grace: its step ends and run_step records the exit
LISTED_WAIT_S = 30.0  # for every frontend to list a new replica's instance once it is ready


@contextlib.contextmanager
def _try_lock(state: StateDir) -> Iterator[bool]:
    """The state dir's lock if it is free now (False: `up` or `down` holds it)."""
    state.ensure()
    with state.lock_file.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class JobPools:
    """The autoscaled pools of a running job, as the autoscaler sees them (planner.Pools)."""

    def __init__(self, state: StateDir, job_id: str) -> None:
        self.state = state
        self.root = state.root
        self.slurm_state = SlurmState(state)
        self.job_id = job_id
        self.parent = os.getppid()  # the batch script: when it is gone, so is the job
        self.instances: dict[str, tuple[float | None, str]] = {}  # name -> (its run's start, instance)

    @property
    def stopping(self) -> bool:
        return os.getppid() != self.parent

    def plan(self) -> Plan:
        """The job's plan (as `up` wrote it) with what it resolved, standby replicas included."""
        plan, resolved = self.state.read_plan(), self.slurm_state.resolved()
        assert plan is not None and resolved is not None, "the job script starts the planner after both"
        return fill_plan(plan, resolved)

    def policies(self) -> dict[str, AutoscalePolicy]:
        return self.plan().autoscale

    def busy(self) -> bool:
        with _try_lock(self.state) as free:
            return not free

    async def answers(self) -> dict[str, Answers]:
        plan = job.running_plan(self.slurm_state, self.plan())
        records = job.records(self.slurm_state, plan, True)
        first = node_order({p.host for p in [*plan.processes, *plan.standby]})[0]  # where this runs
        resolved = self.slurm_state.resolved() or {}
        urls = [
            fill_text(probe_target(p, p.host == first), resolved)
            for p in plan.processes
            if p.shares_ports and p.readiness.target.endswith("/health") and records[p.name].state == "ready"
        ]
        documents = await asyncio.gather(*(health_at(url, asyncio.open_connection, None) for url in urls))
        return tally([d for _, d in filter(None, documents)])

    def members(self, pool: str) -> list[Member]:
        plan = job.running_plan(self.slurm_state, self.plan())
        records = job.records(self.slurm_state, plan, True)
        return [
            Member(p, records[p.name].state == "ready", self._instance(p.name, records[p.name].started_at))
            for p in plan.processes
            if p.component == pool
        ]

    def current(self, pool: str) -> int:
        return sum(m.spec.rank == 0 for m in self.members(pool))

    async def scale(self, pool: str, replicas: int) -> bool:
        with _try_lock(self.state) as free:
            if not free:
                return False
            plan = self.plan()
            every = [p for p in [*plan.processes, *plan.standby] if p.component == pool]
            running = job.running_plan(self.slurm_state, plan).processes
            on = sorted({p.replica for p in running if p.component == pool})
            if replicas < len(on):  # the newest first, every rank of each
                retiring = [p for p in every if p.replica in on[replicas:]]
                for spec in retiring:  # every rank's `.off` first: none restarts, nor takes the others down
                    self._off(spec).touch()
                for spec in reversed(retiring):
                    await self._retire(spec)
                return True
            more = sorted({p.replica for p in every} - set(on))[: replicas - len(on)]
            for i, replica in enumerate(more):
                if (why := await self._start([p for p in every if p.replica == replica])) is not None:
                    self.report(f"autoscale {pool}: {why}; the pool keeps what it had")
                    for started in reversed([p for p in every if p.replica in more[: i + 1]]):
                        await self._retire(started)
                    return False
            return bool(more)

    def _off(self, spec: ProcessSpec) -> Path:
        """While this file exists the process does not run (script.py's run_step)."""
        return self.slurm_state.job_dir / "steps" / f"{spec.name}.off"

    def report(self, line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    async def _start(self, ranks: list[ProcessSpec]) -> str | None:
        """Let a standby (or retired) replica run, all its ranks at once (a multi-node leader is
        ready only once the others joined it); None once each is ready and the leader listed,
        else which one did not get there and why."""
        since = {spec.name: len(self.slurm_state.events(spec.name)) for spec in ranks}
        for spec in ranks:
            self._off(spec).unlink(missing_ok=True)
        for spec in ranks:
            ready_by = time.monotonic() + spec.readiness.timeout_s + STOP_MARGIN_S
            while time.monotonic() < ready_by:
                kinds = [e[0] for e in self.slurm_state.events(spec.name)[since[spec.name] :]]
                if "exit" in kinds or "unready" in kinds:
                    return f"{spec.name} did not become ready"
                if "ready" in kinds:
                    break
                await asyncio.sleep(POLL_S)
            else:
                return f"{spec.name} was not ready in {spec.readiness.timeout_s:g} s"
        spec = ranks[0]  # the leader: the one the frontends list
        listed_by = time.monotonic() + LISTED_WAIT_S
        while time.monotonic() < listed_by:
            instance = self._instance(spec.name, None)
            if instance is not None and instance in await self.answers():
                return None
            await asyncio.sleep(POLL_S)
        return f"{spec.name} was not listed by the frontends in {LISTED_WAIT_S:g} s"

    async def _retire(self, spec: ProcessSpec) -> None:
        """Stop a replica for good: `.off` first (run_step does not restart it), then SIGTERM to its
        step, which drains; SIGKILL past its grace."""
        self._off(spec).touch()
        since = len(self.slurm_state.events(spec.name))
        try:
            step = job.steps(self.job_id).get(spec.name)
        except SlurmError:
            step = None
        if step is None:
            return  # between runs, or never started: run_step reads the `.off` first
        step_id = step.split()[0]
        job.signal_step(step_id, "TERM")
        end_by = time.monotonic() + spec.shutdown_grace_s + STOP_MARGIN_S
        while not any(e[0] in ("exit", "off") for e in self.slurm_state.events(spec.name)[since:]):
            if time.monotonic() > end_by:
                job.signal_step(step_id, "KILL")
                return
            await asyncio.sleep(POLL_S)

    def _instance(self, name: str, started_at: float | None) -> str | None:
        """The instance id the replica's current run announced in its log (read once per run,
        known by its start time; None: read it now)."""
        known = self.instances.get(name)
        if known is not None and started_at is not None and known[0] == started_at:
            return known[1]
        try:
            text = self.state.log_file(name).read_text(errors="replace")
        except FileNotFoundError:
            return None
        found = INSTANCE_LINE.findall(text[text.rfind(START_MARKER) :])
        if not found:
            return None
        self.instances[name] = (started_at, found[-1])
        return found[-1]


def main(argv: list[str]) -> int:
    """`python -m dynamo_graph.graph.targets.slurm.autoscale STATE_DIR JOB_ID`, from the job script."""
    root, job_id = argv
    asyncio.run(Autoscaler(JobPools(StateDir(Path(root)), job_id)).run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
