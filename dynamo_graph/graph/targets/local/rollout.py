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

A component whose `rollout.strategy` is `canary` is replaced as a whole instead: its new runs
take a growing share of its requests, step by step, and each step is judged against the old
runs before the next (`_canary`; the split and the judging are canary.py's).

A new run that fails (exits, misses its readiness timeout, is never routable, loses its canary
comparison) stops the rollout: it is stopped, and every process already replaced gets its
previous run back the same way (new beside old), so the graph ends as it was. The revision is
recorded as failed with the process, why, and its last log lines; `up` prints them and exits
non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import NamedTuple, Protocol

from dynamo_graph.graph.plan import Plan, ProcessSpec, RolloutPolicy
from dynamo_graph.graph.targets.local.answers import (
    frontend_answers,
    health_of,
    instance_of,
    serving_frontends,
    side,
)
from dynamo_graph.graph.targets.local.canary import RolloutFailed, TrafficSplit, judge
from dynamo_graph.graph.targets.local.changes import PlanChanges
from dynamo_graph.graph.targets.local.checks import check_revision
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

    def progress(self, text: str) -> None: ...


FAILURE_LOG_LINES = 20
ROUTABLE_POLL_S = 0.05
CANARY_POLL_S = 1.0  # how often a canary step looks at the answers (it fails early on errors)
CANARY_MAX_PAUSES = 3  # a step waits this many pauses at most for `min_requests` a side
SERVING_ROLES = ("agg", "decode")  # workers a frontend lists as a model's instances


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
    """The rolled processes grouped by component (dependency order), each component's replicas
    cut into batches of `max_surge + max_unavailable` (a canary's is one batch). The ranks of a
    replica over several nodes count as one replica and stay in one batch: they start, prove
    themselves (the leader is ready only once they all joined) and retire together."""
    specs = {p.name: p for p in plan.processes}
    by_component: dict[str, dict[str, list[str]]] = {}
    for name in dependency_order(plan, names):
        replicas = by_component.setdefault(specs[name].component, {})
        replicas.setdefault(specs[name].group or name, []).append(name)
    out = []
    for replicas in by_component.values():
        groups = list(replicas.values())
        policy = specs[groups[0][0]].rollout
        size = max(policy.max_surge + policy.max_unavailable, 1)
        if policy.strategy == "canary":
            size = len(groups)
        out += [[n for group in groups[i : i + size] for n in group] for i in range(0, len(groups), size)]
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
        self.checked: set[str] = set()  # components whose new runs passed the graph's checks

    async def run(self, revision: int) -> tuple[bool, str]:
        """Apply the changes as `revision`: (True, "") when done; (False, why) when a new run
        failed (and, unless this is the first revision, everything was rolled back)."""
        self.revision = revision
        sup, changes = self.sup, self.changes
        try:
            await self._in_place()
            plan = sup.plan
            assert plan is not None
            specs = {p.name: p for p in plan.processes}
            for batch in batches(plan, changes.rolled):
                batch = [n for n in batch if n not in self.replaced]  # a handover took the rest
                if batch and specs[batch[0]].rollout.strategy == "canary":
                    await self._canary(batch)
                elif batch:
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
        # The first failure ends the wait: a worker that gave up would otherwise be reported only
        # when a frontend waiting for its model ran out of readiness time.
        waiting = {asyncio.ensure_future(r.proven()): r for r in runners}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                failed = [waiting[p] for p in done if not p.result()]
                for proven in done:
                    del waiting[proven]
                if failed:  # the one that failed itself, not a dependent that ended with it
                    raise RolloutFailed(self._why(min(failed, key=lambda r: r.blocked_by is not None)))
        finally:
            for proven in waiting:
                proven.cancel()
        await self._wait_routable(runners)

    async def _roll_batch(self, batch: list[str]) -> None:
        """New runs beside the old ones (the first `max_unavailable` old ones stop first); once
        the new ones proved themselves, the old ones retire."""
        sup = self.sup
        assert sup.plan is not None
        specs = {p.name: p for p in sup.plan.processes}
        # the first `max_unavailable` replicas' runs (every rank of a replica over nodes)
        unavailable = list(dict.fromkeys(specs[n].group or n for n in batch))[
            : specs[batch[0]].rollout.max_unavailable
        ]
        early = [n for n in batch if (specs[n].group or n) in unavailable]
        await self._retire([self.old[n] for n in early])
        new = []
        try:
            async with self._held_back(specs[batch[0]]):
                for name in batch:
                    if name not in early:
                        sup.retire(self.old[name])
                    sup.runners[name] = Runner(sup, specs[name], self.revision, proving=True)
                    new.append(sup.runners[name])
                sup.persist()
                await self._prove(new)
                await self._check(new)
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

    async def _canary(self, names: list[str]) -> None:
        """One component's new runs take each step's share of its requests, as many of them
        running beside all the old runs as the share asks (at least one); each step but the
        last (100) is judged. A failed step stops the new runs and the old ones serve on."""
        sup = self.sup
        assert sup.plan is not None
        specs = {p.name: p for p in sup.plan.processes}
        policy = specs[names[0]].rollout
        component = specs[names[0]].component
        old_ids = {i for n in names if (i := instance_of(self.old[n]))}
        new: list[Runner] = []
        async with TrafficSplit(specs[names[0]], self.revision) as split:
            try:
                for number, step in enumerate(policy.steps, 1):
                    checking = self._wants_check(specs[names[0]])
                    # Before a new run registers, so it never gets more (none while it is checked).
                    await split.share(0.0 if checking else step / 100)
                    wanted = max(1, math.ceil(step * len(names) / 100))
                    started = []
                    for name in names[len(new) : wanted]:
                        sup.retire(self.old[name])
                        sup.runners[name] = Runner(sup, specs[name], self.revision, proving=True)
                        started.append(sup.runners[name])
                    new += started
                    sup.persist()
                    try:
                        await self._prove(started)
                    except CardChanged as changed:
                        raise RolloutFailed(
                            f"{changed}: a canary cannot change the model card (both revisions must "
                            "serve one model the same way); roll it with `strategy: rolling`"
                        ) from None
                    if checking:
                        await self._check(started)
                        await split.share(step / 100)
                    if step == 100:
                        break
                    where = f"canary {component}, step {number} of {len(policy.steps)}: {step}% of requests"
                    new_ids = {i for r in new if (i := instance_of(r))}
                    await self._judge_step(policy, where, new_ids, old_ids)
            except RolloutFailed:
                await split.share(0.0)  # no new requests to the new runs; theirs finish
                await stop_in_order(new)
                for name in names[: len(new)]:
                    sup.runners[name] = sup.unretire(self.old[name])
                sup.persist()
                raise
        await self._retire([self.old[n] for n in names])
        self.replaced += names

    def _wants_check(self, spec: ProcessSpec) -> bool:
        return (
            spec.rollout.checks
            and spec.role in SERVING_ROLES
            and spec.component not in self.checked
            and bool(self.sup.plan and self.sup.plan.graph_json)
        )

    def _held_back(self, spec: ProcessSpec) -> contextlib.AbstractAsyncContextManager[object]:
        """While a component's first new runs are checked, the frontends send them nothing (a
        traffic split of share 0): users meet them only once they passed."""
        if not self._wants_check(spec):
            return contextlib.nullcontext()
        return _split_at(TrafficSplit(spec, self.revision), 0.0)

    async def _check(self, runners: Sequence[Runner]) -> None:
        """The graph's checks against a component's first new runs, when its rollout asks
        (`checks: true`; checks.py). A prefill pool is left out: a frontend of its own would
        have none of the new revision's decode workers to pair it with."""
        if not runners or not self._wants_check(runners[0].spec):
            return
        sup = self.sup
        assert sup.plan is not None
        component = runners[0].spec.component
        self.checked.add(component)
        sup.progress(f"checks against the new {component} replicas")
        why = await check_revision(sup.state, sup.plan, runners[0].spec, self.revision)
        if why is not None:
            raise RolloutFailed(f"the graph's checks failed against the new {component} replicas:\n{why}")
        sup.progress(f"checks against the new {component} replicas passed")

    async def _judge_step(
        self, policy: RolloutPolicy, where: str, new_ids: set[str], old_ids: set[str]
    ) -> None:
        """Serve one step for its pause (longer, up to CANARY_MAX_PAUSES, until both sides
        answered `min_requests`), then judge it; raises RolloutFailed when the new side lost
        (at once when its errors already lose)."""
        sup = self.sup
        sup.progress(f"{where}, judged after {policy.pause_s:g} s")
        before = await frontend_answers(self._frontends())
        started = time.monotonic()
        while True:
            await asyncio.sleep(CANARY_POLL_S)
            after = await frontend_answers(self._frontends())
            new, old = side(before, after, new_ids), side(before, after, old_ids)
            elapsed = time.monotonic() - started
            early = judge(new, old, policy, errors_only=True)
            if not early.ok and new.requests >= policy.min_requests:
                raise RolloutFailed(f"{where}: {early.why}")
            if elapsed < policy.pause_s:
                continue
            enough = min(new.requests, old.requests) >= policy.min_requests
            if enough or elapsed >= CANARY_MAX_PAUSES * policy.pause_s:
                break
        verdict = judge(new, old, policy)
        if not verdict.ok:
            raise RolloutFailed(f"{where}: {verdict.why}")
        sup.progress(f"{where}: passed ({verdict.why})")

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
        await self._check([sup.runners[n] for n in batch])
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
        return serving_frontends(self.sup.runners.values())

    async def _wait_routable(self, runners: Sequence[Runner], handing_over: bool = False) -> None:
        """Until every ready frontend lists the new worker runs among its model's instances.
        Raises CardChanged when one refuses them all for their model card (unless
        `handing_over`: then old cards may still be leaving), RolloutFailed when time is up."""
        ids = {r.spec.name: i for r in runners if r.spec.role in SERVING_ROLES and (i := instance_of(r))}
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


@contextlib.asynccontextmanager
async def _split_at(split: TrafficSplit, share: float) -> AsyncIterator[TrafficSplit]:
    async with split:
        await split.share(share)
        yield split


class Listed(NamedTuple):
    """A frontend's worker instances, as its /health lists them: routable ones and those it
    refused for their model card."""

    instances: set[str]
    refused: set[str]


async def _listed(frontend: Runner) -> Listed | None:
    """The worker instances a frontend lists in /health (None when it cannot be asked)."""
    answer = await health_of(frontend)
    if answer is None:
        return None
    status, health = answer
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
