"""Making a changed plan the running one while it serves: the rollout of one revision.

Per changed component, in dependency order, its replicas are replaced in batches. A process
that `rolls` (a frontend, a dynamic worker) gets its new run started beside the old one: up to
`max_surge` new runs at a time, while up to `max_unavailable` old ones may stop first. A new
run must prove itself: ready by its probe (one try, no restarts), and a worker must also be
listed by every running frontend (registered and routable), before the old run it replaces is
retired: SIGTERM, after which a worker leaves discovery at once and finishes its streams within
its grace, and a frontend stops accepting and finishes its streams while the new one, on the
same port (SO_REUSEPORT), takes the new connections. A process that cannot run twice (etcd,
nats, a static worker on its fixed port) stops first, and what depends on it restarts with it.
New processes start (and must prove themselves) before removed ones retire, so scaling down
and removing a component retire the same way.

A new run that fails (exits, misses its readiness timeout, is never routable) stops the
rollout: it is stopped, and every process already replaced gets its previous run back the same
way (new beside old), so the graph ends as it was. The revision is recorded as failed with the
process, why, and its last log lines; `up` prints them and exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local import probes
from dynamo_graph.graph.targets.local.changes import PlanChanges
from dynamo_graph.graph.targets.local.logs import tail_lines
from dynamo_graph.graph.targets.local.runner import Fleet, Runner, stop_in_order


class RollingFleet(Fleet, Protocol):
    """What a rollout needs of the supervisor (supervisor.py): its runners and plan, and the
    old runs it keeps watching while they retire."""

    plan: Plan | None
    ports: dict[str, int]

    def retire(self, runner: Runner) -> None: ...

    def unretire(self, runner: Runner) -> Runner: ...

    def forget_retired(self, runners: Iterable[Runner]) -> None: ...

    def order(self) -> None: ...


FAILURE_LOG_LINES = 20
ROUTABLE_POLL_S = 0.05
SERVING_ROLES = ("agg", "decode")  # workers a frontend lists as a model's instances
INSTANCE_LINE = re.compile(r"instance ([0-9a-f]+) serving")


class RolloutFailed(Exception):
    """A new run did not prove itself; the message names it and says why."""


class CardChanged(RolloutFailed):
    """The frontends refuse the new runs for their model card (see Rollout._hand_over)."""


def dependency_order(plan: Plan, names: Sequence[str]) -> list[str]:
    """`names` with every process after the processes it depends on (the plan order otherwise)."""
    specs = {p.name: p for p in plan.processes}
    ordered: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name not in specs:
            return
        seen.add(name)
        for dep in specs[name].depends_on:
            visit(dep)
        ordered.append(name)

    for spec in plan.processes:
        visit(spec.name)
    wanted = set(names)
    return [n for n in ordered if n in wanted]


def batches(plan: Plan, names: Sequence[str]) -> list[list[str]]:
    """The rolled processes grouped by component (dependency order), each component's cut into
    batches of `max_surge + max_unavailable`."""
    specs = {p.name: p for p in plan.processes}
    by_component: dict[str, list[str]] = {}
    for name in dependency_order(plan, names):
        by_component.setdefault(specs[name].component, []).append(name)
    out = []
    for members in by_component.values():
        policy = specs[members[0]].rollout
        size = max(policy.max_surge + policy.max_unavailable, 1)
        out += [members[i : i + size] for i in range(0, len(members), size)]
    return out


class Rollout:
    """The background task that applies one revision's changes (see the module docstring)."""

    def __init__(
        self,
        sup: RollingFleet,
        changes: PlanChanges,
        old: dict[str, Runner],
        old_plan: Plan | None,
        old_ports: dict[str, int],
    ) -> None:
        self.sup = sup
        self.changes = changes
        self.old = old  # name -> the runner of the previous revision (changed and removed ones)
        self.old_plan = old_plan
        self.old_ports = old_ports  # before the new runs got fresh ones: restored on rollback
        self.revision = 0
        self.replaced: list[str] = []  # rolled names whose new run took over, in order

    async def run(self, revision: int) -> tuple[bool, str]:
        """Apply the changes as `revision`: (True, "") when done; (False, why) when a new run
        failed (and, unless this is the first revision, everything was rolled back)."""
        self.revision = revision
        sup, changes = self.sup, self.changes
        try:
            await self._in_place()
            plan = sup.plan
            assert plan is not None
            for batch in batches(plan, changes.rolled):
                batch = [n for n in batch if n not in self.replaced]  # a handover took the rest
                if batch:
                    await self._roll_batch(batch)
            # Started at once; proven after the changed replicas, whose model card they share.
            await self._prove([sup.runners[n] for n in changes.added if n in sup.runners])
            await self._retire([self.old[n] for n in changes.removed])
            return True, ""
        except RolloutFailed as failure:
            if self.old_plan is not None:  # the first revision has nothing to go back to
                await self._roll_back()
            return False, str(failure)

    async def _in_place(self) -> None:
        """Processes that cannot run twice: stop the old runs (dependents first), start the new."""
        sup, changes = self.sup, self.changes
        going = changes.stops_first
        if not going:
            return
        await stop_in_order([self.old[n] for n in going])
        specs = {p.name: p for p in sup.plan.processes} if sup.plan else {}
        started = []
        for name in going:
            sup.runners[name] = Runner(sup, specs[name], self.revision, proving=True)
            started.append(sup.runners[name])
        sup.order()
        sup.persist()
        await self._prove(started)

    async def _prove(self, runners: Sequence[Runner]) -> None:
        """Wait for every runner's first run to be ready, and for the workers among them to be
        routable; raises RolloutFailed naming the first that was not."""
        if not runners:
            return
        results = await asyncio.gather(*(r.proven() for r in runners))
        for runner, ok in zip(runners, results, strict=True):
            if not ok:
                raise RolloutFailed(self._why(runner))
        await self._wait_routable(runners)

    async def _roll_batch(self, batch: list[str]) -> None:
        """New runs beside the old ones (the first `max_unavailable` old ones stop first); once
        the new ones proved themselves, the old ones retire."""
        sup = self.sup
        assert sup.plan is not None
        specs = {p.name: p for p in sup.plan.processes}
        early = batch[: specs[batch[0]].rollout.max_unavailable]
        await self._retire([self.old[n] for n in early])
        new = []
        for name in batch:
            if name not in early:
                sup.retire(self.old[name])
            sup.runners[name] = Runner(sup, specs[name], self.revision, proving=True)
            new.append(sup.runners[name])
        sup.persist()
        try:
            await self._prove(new)
        except CardChanged as changed:
            await self._hand_over(batch, changed)
            return
        except RolloutFailed:
            await stop_in_order(new)
            for name in batch:  # the old runs serve again; the stopped ones start again
                if name in early:
                    sup.runners[name] = Runner(sup, self.old[name].spec, self.old[name].record.revision)
                else:
                    sup.runners[name] = sup.unretire(self.old[name])
            sup.persist()
            raise
        await self._retire([self.old[n] for n in batch if n not in early])
        self.replaced += batch

    async def _hand_over(self, batch: list[str], changed: CardChanged) -> None:
        """The new runs serve a model card the old ones do not (another template, context
        length, parser, KV block size): a frontend routes one card per model, so it refuses
        them while an old run is left. Start the component's remaining new runs beside the old
        ones, retire every old run (streams finish), and the frontends take the new card when
        the last old one leaves (requests meanwhile wait for a worker, `limits.model_wait_s`)."""
        sup = self.sup
        assert sup.plan is not None
        specs = {p.name: p for p in sup.plan.processes}
        component = specs[batch[0]].component
        rest = [n for n in self.changes.rolled if specs[n].component == component and n not in batch]
        rest = [n for n in rest if n not in self.replaced]
        sup.report("dyngraph", f"{changed}: handing {component} over to the new card at once")
        started = []
        for name in rest:
            sup.retire(self.old[name])
            sup.runners[name] = Runner(sup, specs[name], self.revision, proving=True)
            started.append(sup.runners[name])
        sup.persist()
        for runner, ok in zip(started, await asyncio.gather(*(r.proven() for r in started)), strict=True):
            if not ok:
                raise RolloutFailed(self._why(runner))
        await self._retire([self.old[n] for n in [*batch, *rest]])
        self.replaced += [*batch, *rest]
        await self._wait_routable([sup.runners[n] for n in [*batch, *rest]], handing_over=True)

    async def _roll_back(self) -> None:
        """Give every process this rollout touched its previous run back, new beside old."""

        sup = self.sup
        changes = self.changes
        await stop_in_order([sup.runners[n] for n in changes.added if n in sup.runners])
        for name in changes.added:
            sup.runners.pop(name, None)
        for name in changes.removed:  # never retired: they serve on
            sup.runners[name] = sup.unretire(self.old[name])
        sup.plan = self.old_plan
        sup.ports = dict(self.old_ports)
        for name in reversed(self.replaced):
            current = sup.runners[name]
            previous = Runner(sup, self.old[name].spec, self.old[name].record.revision)
            sup.retire(current)
            sup.runners[name] = previous
            sup.persist()
            if await previous.proven():
                await self._retire([current])
            else:
                sup.report(name, "the previous run did not come back either: " + self._why(previous))
        for name in changes.stops_first:
            if name in sup.runners and sup.runners[name].spec != self.old[name].spec:
                await stop_in_order([sup.runners[name]])
                sup.runners[name] = Runner(sup, self.old[name].spec, self.old[name].record.revision)
        sup.order()
        sup.persist()

    async def _retire(self, runners: Sequence[Runner]) -> None:
        """Stop old runs (a worker leaves routing at once and finishes its streams)."""

        for runner in runners:
            self.sup.retire(runner)
        self.sup.persist()
        await stop_in_order(runners)
        self.sup.forget_retired(runners)

    def _why(self, runner: Runner) -> str:
        record = runner.record
        tail = "\n".join(tail_lines(self.sup.state.log_file(runner.spec.name), FAILURE_LOG_LINES))
        why = record.message or f"exit {record.last_exit}"
        return f"{runner.spec.name} {record.state} ({why}); last log lines:\n{tail}"

    # ---- routable: every running frontend lists the new workers -------------------------------

    def _frontends(self) -> list[Runner]:
        return [
            r
            for r in self.sup.runners.values()
            if r.spec.shares_ports and r.ready.is_set() and r.spec.readiness.target.endswith("/health")
        ]

    async def _wait_routable(self, runners: Sequence[Runner], handing_over: bool = False) -> None:
        """Until every ready frontend lists the new worker runs among its model's instances.
        Raises CardChanged when one refuses them all for their model card (unless
        `handing_over`: then old cards may still be leaving), RolloutFailed when time is up."""
        ids = {r.spec.name: i for r in runners if r.spec.role in SERVING_ROLES and (i := _instance_of(r))}
        if not ids:
            return
        timeout = max(r.spec.readiness.timeout_s for r in runners)
        deadline = time.monotonic() + timeout
        waiting = {r.spec.name: r for r in self._frontends()}
        wanted = set(ids.values())
        while waiting:
            for name, frontend in list(waiting.items()):
                found = await _listed(frontend)
                if found is None:
                    continue
                if wanted <= found.instances:
                    del waiting[name]
                elif not handing_over and wanted <= found.refused:
                    raise CardChanged(f"{name} refuses {', '.join(ids)} for a changed model card")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RolloutFailed(
                    f"{', '.join(ids)}: ready, but not listed by {', '.join(waiting)} within {timeout:g} s "
                    "(not registered in discovery, or refused: see the frontend's /health)"
                )
            await asyncio.sleep(ROUTABLE_POLL_S)


def _instance_of(runner: Runner) -> str | None:
    """The instance id a worker's current run announced in its log ("instance <hex> serving",
    the line its readiness probe waits for)."""
    proc = runner.proc
    if proc is None:
        return None
    try:
        with proc.log_path.open("rb") as log:
            log.seek(proc.log_offset)
            found = INSTANCE_LINE.search(log.read().decode(errors="replace"))
    except FileNotFoundError:
        return None
    return found.group(1) if found else None


class Listed(NamedTuple):
    """A frontend's worker instances, as its /health lists them: routable ones and those it
    refused for their model card."""

    instances: set[str]
    refused: set[str]


async def _listed(frontend: Runner) -> Listed | None:
    """The worker instances a frontend lists in /health (None when it cannot be asked)."""
    proc = frontend.proc
    if proc is None:
        return None
    try:
        async with asyncio.timeout(probes.ATTEMPT_TIMEOUT_S):
            target = frontend.spec.readiness.target
            status, headers, body = await probes.http_get(target, proc.open_connection)
        health = json.loads(body)
    except (OSError, TimeoutError, ValueError, IndexError):
        return None
    if headers.get(probes.PID_HEADER, str(proc.pid)) != str(proc.pid):
        return None  # another process on the port answered (a replica): ask again
    details = health.get("details") if isinstance(health, dict) else None
    if not isinstance(details, dict):
        return Listed(set(), set()) if status in (200, 503) else None
    models = [m for m in details.values() if isinstance(m, dict)]

    def ids(entries: object, state: str | None = None) -> set[str]:
        if not isinstance(entries, list):
            return set()
        return {
            str(e.get("instance_id"))
            for e in entries
            if isinstance(e, dict) and (state is None or e.get("state") == state)
        }

    return Listed(
        {i for m in models for i in ids(m.get("instances"))},
        {i for m in models for i in ids(m.get("unavailable"), "refused")},
    )
