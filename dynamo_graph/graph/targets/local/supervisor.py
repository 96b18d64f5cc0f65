"""The supervisor: keeps a plan's processes running (runner.py) and applies changed plans.

`apply(plan)` is both the first start and every later `up`: it diffs the new plan against the
running one by each process's launch identity (changes.py: argv, env, workdir, host, the
engine-args file it is given), records a revision (revisions.py), and rolls the changes out in
the background (rollout.py): new and changed processes start beside the old ones and must
prove themselves before old ones retire, and a failure rolls everything back. Processes that
did not change are left alone. Stopping goes in reverse dependency order: a process stops once
everything depending on it has.

Processes on remote hosts run through the ssh launcher (ssh.py), which the supervisor loads only
for a plan that has remote hosts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from dynamo_graph.graph.plan import LOCAL, Plan, ProcessSpec
from dynamo_graph.graph.targets.local.changes import moved_hosts, plan_changes, unpaired
from dynamo_graph.graph.targets.local.ports import fill_plan
from dynamo_graph.graph.targets.local.process import LocalProcess
from dynamo_graph.graph.targets.local.revisions import Origin, Revision, RevisionStore, serving
from dynamo_graph.graph.targets.local.rollout import Rollout
from dynamo_graph.graph.targets.local.runner import Report, Runner, stop_in_order
from dynamo_graph.graph.targets.local.state import StateDir, atomic_write

if TYPE_CHECKING:
    from dynamo_graph.graph.targets.local.remote.ssh import RemoteProcess, SshHosts


class Supervisor:
    """The running plan: its runners, the ports it filled, and the records it persists."""

    def __init__(self, state: StateDir, report: Report) -> None:
        self.state = state
        self.report = report
        self.ports: dict[str, int] = {}
        self.runners: dict[str, Runner] = {}
        self.plan: Plan | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.ssh: SshHosts | None = None  # connections to the plan's remote hosts, once it has any
        self.retiring: list[Runner] = []  # old runs a rollout replaces, until they stopped
        self.revisions = RevisionStore(state.revisions)
        self.revision: Revision | None = None  # the one rolling out, else the one serving
        self.full_plan: Plan | None = None  # as applied: autoscaled pools' standby replicas too
        self.desired: dict[str, int] = {}  # autoscaled components: the replicas to run
        self.scaling = False  # a pool's replicas are being changed (not a revision)

    def launcher(self, spec: ProcessSpec) -> LocalProcess | RemoteProcess:
        """One run of `spec`, on this host or over ssh."""
        log = self.state.log_file(spec.name)
        if spec.host == LOCAL:
            return LocalProcess(spec, log, self.plan.local_python if self.plan else None)
        from dynamo_graph.graph.targets.local.remote.agent import graph_tag
        from dynamo_graph.graph.targets.local.remote.ssh import RemoteProcess

        assert self.ssh is not None, "apply() opens the ssh hosts of a plan with remote processes"
        return RemoteProcess(spec, log, self.ssh, graph_tag(self.state.root))

    def persist(self) -> None:
        records = [r.record for r in self.runners.values()]
        self.state.write_processes([*records, *(r.record for r in self.retiring)])

    def retire(self, runner: Runner) -> None:
        """`runner` (an old run) leaves the plan's runners but is still watched until it stops."""
        runner.record.retiring = True
        if runner not in self.retiring:
            self.retiring.append(runner)

    def unretire(self, runner: Runner) -> Runner:
        """A rollback keeps an old run that was about to retire."""
        runner.record.retiring = False
        if runner in self.retiring:
            self.retiring.remove(runner)
        return runner

    def forget_retired(self, runners: Iterable[Runner]) -> None:
        for runner in runners:
            if runner in self.retiring:
                self.retiring.remove(runner)
        self.persist()

    def progress(self, text: str) -> None:
        """Where the rollout is (a canary's step), for `status` and the supervisor's log."""
        if self.revision is not None:
            self.revisions.progress(self.revision, text)
        self.report("dyngraph", text)

    @property
    def rolling(self) -> Revision | None:
        """The revision being rolled out, if one is."""
        return self.revision if self.revision is not None and self.revision.outcome == "rolling" else None

    async def apply(self, raw: Plan, origin: Origin) -> tuple[list[str], int]:
        """Make `raw` the running plan; returns the changes as `+ name`, `~ name`, `- name`, and
        the revision that applies them (the current one when nothing changed). The rollout goes
        on in the background (rollout.py); what waits here is asking remote hosts for their
        `auto` ports (raises SshError when one cannot be asked). Refused (RolloutBusy) while
        another revision or a scaling is still rolling out, Refused for a change prefill and
        decode workers could not roll through (changes.unpaired). An autoscaled component keeps
        the replicas its planner chose (within the new plan's bounds)."""
        if (rolling := self.rolling) is not None:
            raise RolloutBusy(
                f"revision {rolling.number} is still rolling out (`dyngraph status` shows it); "
                "apply again once it is done"
            )
        if self.scaling:
            raise RolloutBusy("the autoscaler is changing a pool's replicas; apply again in a moment")
        for component, policy in raw.autoscale.items():
            start = self.desired.get(
                component, sum(p.component == component and p.rank == 0 for p in raw.processes)
            )
            self.desired[component] = min(max(start, policy.min_replicas), policy.max_replicas)
        plan = scaled(raw, self.desired)
        if (why := unpaired(self.plan, plan)) is not None:
            raise Refused(why)
        lines, filled, rollout = await self._changes(plan)
        if not lines and self.revision is not None:
            return [], self.revision.number
        if raw.tls is not None:
            self._issue(raw)
        revision = self.revisions.begin(origin, raw, lines)
        self.revision = revision
        self.full_plan = raw
        self._start(filled, rollout, revision.number, self._roll(rollout, revision))
        return lines, revision.number

    def _issue(self, plan: Plan) -> None:
        """New certificates for every process of a new revision (graph/tls.py: rotation); the
        CA is only replaced while nothing runs that trusts it."""
        from dynamo_graph.graph.tls import CA_RENEW_DAYS, issue_all

        assert plan.tls is not None
        ca = issue_all(plan.tls.dir, plan.graph, plan.tls.names, renew=self.plan is None)
        if ca.days_left() < CA_RENEW_DAYS:
            days = ca.days_left()
            self.report("dyngraph", f"the graph's CA expires in {days:.0f} days: `down` and `up` renew it")

    async def scale(self, component: str, replicas: int) -> list[str] | None:
        """Run `replicas` of an autoscaled component (the planner's decision) through the same
        rollout as a change (new replicas prove themselves, removed ones retire and drain), as
        part of the serving revision; None when a rollout is in progress (ask again later)."""
        if self.rolling is not None or self.scaling or self.stopping or self.full_plan is None:
            return None
        before = self.desired.get(component)
        self.desired[component] = replicas
        lines, filled, rollout = await self._changes(scaled(self.full_plan, self.desired))
        if not lines:
            return []
        number = self.revision.number if self.revision is not None else 0
        self.scaling = True
        self._start(filled, rollout, number, self._scaled(rollout, number, component, before))
        return lines

    async def _changes(self, raw: Plan) -> tuple[list[str], Plan, Rollout]:
        """How `raw` differs from what runs: its lines, the plan with its ports filled, and the
        rollout that would apply it."""
        if raw.hosts:
            from dynamo_graph.graph.targets.local.remote.ssh import SshHosts

            if self.ssh is None:
                self.ssh = SshHosts({})
            self.ssh.update(raw.hosts)
            await self.ssh.allocate_ports(raw, self.ports)
        moved = moved_hosts(self.plan, raw)
        ports_before = dict(self.ports)
        plan = fill_plan(raw, self.ports)
        old = dict(self.runners)
        old_specs = {n: r.spec for n, r in old.items()}
        old_files = self.plan.files if self.plan else {}
        changes = plan_changes(old_specs, old_files, plan, moved)
        rollout = Rollout(self, changes, old, self.plan, ports_before)
        if changes.rolled:
            plan = fill_plan(raw, self._fresh_ports(raw, changes.rolled))
        return changes.lines(), plan, rollout

    def _start(self, plan: Plan, rollout: Rollout, number: int, done: Coroutine[None, None, None]) -> None:
        """Make `plan` the running one and start `rollout` on it, as `number`'s processes."""
        changes = rollout.changes
        old = rollout.old
        for path, text in plan.files.items():
            atomic_write(Path(path), text)
        old_plan = self.plan
        self.plan = plan
        new = {p.name: p for p in plan.processes}
        for name, runner in old.items():
            if name in new and name not in changes.restarted:
                runner.spec = new[name]  # the same process; its dependencies or policy may differ
        for name in changes.added:
            # The first revision's processes restart as their policy says; later ones prove themselves.
            self.runners[name] = Runner(self, new[name], number, proving=old_plan is not None)
        for name in changes.removed:
            self.retire(self.runners.pop(name))
        self.order()
        self.state.write_plan(plan)
        self.state.write_ports(self.ports)
        self.persist()
        task = asyncio.create_task(done, name=f"rollout {number}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _scaled(self, rollout: Rollout, number: int, component: str, before: int | None) -> None:
        """Run a scaling's rollout; if a new replica failed, the pool keeps what it had."""
        try:
            ok, why = await rollout.run(number)
        finally:
            self.scaling = False
        if self.stopping:
            return
        if ok:
            self.report("dyngraph", f"{component}: {', '.join(rollout.changes.lines())}")
            return
        if before is not None:
            self.desired[component] = before
        self.state.write_plan(rollout.old_plan or self.plan)
        self.state.write_ports(self.ports)
        self.report("dyngraph", f"{component}: scaling failed and was undone: {why}")

    def _fresh_ports(self, raw: Plan, rolled: list[str]) -> dict[str, int]:
        """The ports with the `auto` ones of rolled processes forgotten, so their new runs get
        free ones beside the old runs (unless they share theirs: a frontend's)."""
        for spec in raw.processes:
            if spec.name in rolled and not spec.shares_ports:
                for name, port in spec.ports.items():
                    if port == "auto":
                        self.ports.pop(name, None)
        return self.ports

    async def _roll(self, rollout: Rollout, revision: Revision) -> None:
        """Run the rollout, then record how it ended (the revision file `up` waits on)."""
        ok, why = await rollout.run(revision.number)
        if self.stopping:
            return
        if ok:
            self.revisions.finish(revision, "ready")
            self.report("dyngraph", f"revision {revision.number} is ready")
            return
        rolled_back = rollout.old_plan is not None  # a first start has nothing to go back to
        self.revisions.finish(revision, "failed", why, rolled_back)
        if not rolled_back:
            self.report("dyngraph", f"revision {revision.number} failed: {why}")
            return
        self.report("dyngraph", f"revision {revision.number} failed and was rolled back: {why}")
        self.state.write_plan(rollout.old_plan)
        self.state.write_ports(self.ports)
        self.revision = serving(self.revisions.all())
        self.full_plan = self.revision.plan if self.revision is not None else None

    def order(self) -> None:
        """Keep runners (and so processes.json and `status`) in plan order."""
        order = [p.name for p in self.plan.processes] if self.plan else []
        self.runners = {n: self.runners[n] for n in order if n in self.runners}

    async def stop_all(self) -> None:
        """Stop everything: a rollout in progress is cancelled, old runs it kept stop too."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if (rolling := self.rolling) is not None:
            self.revisions.finish(rolling, "failed", "the graph was stopped during its rollout")
        await stop_in_order([*self.runners.values(), *self.retiring])
        self.persist()
        if self.ssh is not None:
            await self.ssh.close()


def scaled(plan: Plan, desired: dict[str, int]) -> Plan:
    """`plan` with `desired` replicas of each autoscaled component: its first ones, from the
    plan's processes then its standby ones, each after the processes before it."""
    if not plan.autoscale:
        return plan
    wanted = [
        p
        for p in [*plan.processes, *plan.standby]
        if p.component not in plan.autoscale or p.replica < desired.get(p.component, 0)
    ]
    order = {p.name: i for i, p in enumerate(plan.processes)}
    last = {p.component: order[p.name] for p in plan.processes}
    ranked = sorted(wanted, key=lambda p: (order.get(p.name, last.get(p.component, len(order))), p.replica))
    return msgspec.structs.replace(plan, processes=ranked)


class Refused(Exception):
    """A plan the supervisor will not apply; the message says why (nothing was changed)."""


class RolloutBusy(Refused):
    """A plan was sent while another revision was still rolling out."""
