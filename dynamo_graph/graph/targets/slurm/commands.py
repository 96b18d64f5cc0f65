"""`dyngraph up --target slurm | status | down` for a graph that runs as a Slurm job; each returns
an exit code. `logs` needs nothing of its own: the steps write to the state dir's `logs/`.

`up` writes the sbatch script (script.py) and the placeholder plan to the state dir, submits the
job, and waits until every process is ready (0) or one failed (1), then writes the plan with
the nodes' addresses and ports the job picked, so `status` and `logs` show what runs where.
On a graph whose job runs, `up` rolls the change into it, or refuses it (rollout.py).
"""

from __future__ import annotations

import getpass
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from rich.console import Console

from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import LOCAL, Plan
from dynamo_graph.graph.targets.local.commands import wait_deadline
from dynamo_graph.graph.targets.local.history import (
    autoscale_decisions,
    autoscale_lines,
    revision_lines,
    when,
)
from dynamo_graph.graph.targets.local.logs import tail_lines
from dynamo_graph.graph.targets.local.revisions import Revision, RevisionStore, origin_of, rollback_target
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.local.ui import frontend_url, status_table
from dynamo_graph.graph.targets.slurm import job, rollout
from dynamo_graph.graph.targets.slurm.job import JobRecord, SlurmError, SlurmState
from dynamo_graph.graph.targets.slurm.script import fill_plan, node_of, node_order, secret_env
from dynamo_graph.graph.tls import issue_all
from dynamo_graph.graph.validate import locate

if TYPE_CHECKING:
    from dynamo_graph.graph.build import Built

POLL_S = 0.2
FAILURE_LOG_LINES = 20
CANCEL_TIMEOUT_S = 120.0  # scancel: SIGTERM, then Slurm's KillWait (30 s by default), then SIGKILL


def before_local_up(built: Built) -> None:
    """Before a graph runs without Slurm: its hosts must all be reachable without it, and no job of
    it may still run. Raises GraphError; forgets a previous, ended job of the graph."""
    used = {p.host for p in built.plan.processes} - {LOCAL} - set(built.plan.hosts)
    problems = [
        Problem(f"hosts.{h}.ssh", "a Slurm node (no `ssh`): run the graph with `dyngraph up --target slurm`")
        for h in sorted(used)
    ]
    problems += [
        Problem(
            f"components.{c}.nodes",
            "a TensorRT-LLM replica over nodes is one MPI job: `dyngraph up --target slurm` starts it as "
            "one `srun --mpi=pmix` step; elsewhere start it under mpirun yourself (`render -f shell`)",
        )
        for c in sorted({p.component for p in built.plan.processes if p.mpi_hosts})
    ]
    slurm_state = SlurmState(StateDir(built.plan.state_dir))
    if (record := slurm_state.job()) is not None:
        try:
            active = job.job_state(record.job_id)[0] in job.ACTIVE
        except SlurmError:
            active = False  # no Slurm here (any more): nothing of it can run
        if active:
            problems.append(
                Problem(
                    "",
                    f"it runs as Slurm job {record.job_id}: change it with `dyngraph up --target slurm`, "
                    "or `dyngraph down` it first",
                )
            )
        else:
            slurm_state.job_file.unlink(missing_ok=True)
    if problems:
        loaded = built.loaded
        raise GraphError([locate(p, loaded.source, str(loaded.file)) for p in problems])


def up(built: Built, console: Console) -> int:
    plan = built.plan
    state = StateDir(plan.state_dir)
    slurm_state = SlurmState(state)
    with state.lock():
        if state.supervisor() is not None:
            console.print(f"[bold red]error:[/] graph {plan.graph} runs locally; `dyngraph down` it first")
            return 1
        previous = slurm_state.job()
        try:
            launch = rollout.job_launch(built)  # GraphError without a `slurm:` section
            active = previous is not None and job.job_state(previous.job_id)[0] in job.ACTIVE
            if plan.tls is not None:  # the nodes share this filesystem: the files are where the plan says
                issue_all(plan.tls.dir, plan.graph, plan.tls.names, renew=not active)
            if active:
                assert previous is not None
                origin = origin_of(plan.graph_file, "up")
                return rollout.roll(launch, plan, origin, console, state, previous)
            placeholders = launch.plan
            state.ensure()
            state.write_plan(placeholders)
            slurm_state.write_script(launch.script)
            _clear(slurm_state)
            job_id = job.submit(slurm_state.script, secret_env(placeholders))
        except SlurmError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False)
            return 1
        slurm_state.write_job(JobRecord(job_id, str(slurm_state.script), time.time()))
        store = RevisionStore(state.revisions)
        added = [f"+ {p.name}" for p in plan.processes]
        revision = store.begin(origin_of(plan.graph_file, "up"), plan, added)
        slurm_state.write_launch(revision.number, msgspec.json.encode(launch))
    console.print(f"graph {plan.graph}: Slurm job {job_id} ({slurm_state.script})", highlight=False)
    try:
        code = _wait_ready(console, state, placeholders, job_id)
        store.finish(revision, "ready" if code == 0 else "failed")
        return code
    except KeyboardInterrupt:
        console.print(f"job {job_id} goes on; `dyngraph down {plan.graph_file}` cancels it", highlight=False)
        return 130


def _clear(slurm_state: SlurmState) -> None:
    """Forget the events of a previous job before the new one writes its own."""
    shutil.rmtree(slurm_state.job_dir, ignore_errors=True)


def _wait_ready(console: Console, state: StateDir, plan: Plan, job_id: str) -> int:
    slurm_state = SlurmState(state)
    started = time.monotonic()
    deadline: float | None = None
    said_pending = False
    while deadline is None or time.monotonic() < deadline:
        job_state, reason = job.job_state(job_id)
        if job_state == "PENDING" and not said_pending:
            why = f" ({reason})" if reason and reason != "None" else ""
            console.print(f"job {job_id} is pending{why}; waiting for its nodes", highlight=False)
            said_pending = True
        if job_state == "RUNNING" and deadline is None:  # the readiness timeouts start now
            deadline = wait_deadline(plan)
        if job_state not in job.ACTIVE:
            console.print(f"[bold red]error:[/] job {job_id} ended ({job_state}) before it was ready")
            _print_tail(console, state.root / "slurm" / f"job-{job_id}.out", f"job-{job_id}")
            return 1
        records = job.records(slurm_state, plan, True)
        failed = [r for r in records.values() if r.state == "failed"]
        if failed:
            for record in failed:
                console.print(f"[bold red]{record.name} failed[/] ({record.message}); last log lines:")
                _print_tail(console, state.log_file(record.name), record.name)
            console.print(f"the rest keeps running; stop it with `dyngraph down {plan.graph_file}`")
            return 1
        if records and all(r.state == "ready" for r in records.values()):
            filled = _write_filled(state, plan)
            console.print(status_table(filled, records, None))
            _print_nodes(console, slurm_state, filled)
            elapsed = time.monotonic() - started
            console.print(f"graph {plan.graph}: {len(records)} processes ready in {elapsed:.2f} s")
            return 0
        time.sleep(POLL_S)
    console.print(f"[bold red]error:[/] processes not ready in time; see `dyngraph status {plan.graph_file}`")
    return 1


def _write_filled(state: StateDir, plan: Plan) -> Plan:
    resolved = SlurmState(state).resolved()
    filled = fill_plan(plan, resolved) if resolved else plan
    state.write_plan(filled)
    return filled


def _print_nodes(console: Console, slurm_state: SlurmState, plan: Plan) -> None:
    """Which node each host key became, and where the frontends serve."""
    resolved = slurm_state.resolved() or {}
    hosts = node_order(p.host for p in [*plan.processes, *plan.standby])
    nodes = ", ".join(f"{h} = {node_of(h, hosts, resolved)}" for h in hosts)
    console.print(f"nodes: {nodes}", highlight=False)
    for spec in plan.processes:
        if url := frontend_url(spec):
            where = node_of(spec.host, hosts, resolved)
            console.print(f"{spec.name}: {url.split(' on host ')[0]} on node {where}", highlight=False)


def _print_tail(console: Console, path: Path, name: str) -> None:
    for line in tail_lines(path, FAILURE_LOG_LINES):
        console.print(f"  {name} | {line}", highlight=False, markup=False)


def status(state: StateDir, console: Console) -> int:
    slurm_state = SlurmState(state)
    record = slurm_state.job()
    plan = state.read_plan()
    assert record is not None, "SlurmTarget.has_record() said so"
    if plan is None:
        console.print(f"graph in {state.root} has never run")
        return 0
    try:
        job_state, reason = job.job_state(record.job_id)
        running_steps = job.steps(record.job_id)
    except SlurmError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 1
    active = job_state in job.ACTIVE
    plan = job.running_plan(slurm_state, plan)  # an autoscaled pool's replicas as its planner left them
    records = job.records(slurm_state, plan, active)
    revisions = RevisionStore(state.revisions).all()
    for name, number in _revisions_of(revisions).items():
        if name in records:
            records[name].revision = number
    console.print(status_table(plan, records, None))
    for line in [*revision_lines(revisions), *autoscale_lines(plan, autoscale_decisions(state), records)]:
        console.print(line, highlight=False)
    why = f" ({reason})" if reason and reason != "None" else ""
    known = job_state or "gone (Slurm no longer lists it)"
    batch_log = slurm_state.root / f"job-{record.job_id}.out"
    console.print(f"Slurm job {record.job_id}: {known}{why}; its own output: {batch_log}", highlight=False)
    if active and slurm_state.resolved():
        _print_nodes(console, slurm_state, plan)
    for name, rec in records.items():
        step = running_steps.get(name)
        if step or rec.message:
            console.print(f"  {name}: {'step ' + step if step else 'no step running'}; {rec.message or 'ok'}")
    return 0


def rollback(state: StateDir, console: Console, number: int | None) -> int:
    """`dyngraph rollback` of a graph that runs as a Slurm job: a recorded revision's launches
    (not the graph file's) rolled into the job as `up` rolls a change; 2 when there is nothing
    to roll back to."""
    slurm_state = SlurmState(state)
    record = slurm_state.job()
    assert record is not None, "SlurmTarget.has_record() said so"
    with state.lock():
        try:
            if job.job_state(record.job_id)[0] not in job.ACTIVE:
                console.print(
                    f"[bold red]error:[/] Slurm job {record.job_id} is not running; `dyngraph up` it first"
                )
                return 2
            target = rollback_target(RevisionStore(state.revisions).all(), number)
        except (LookupError, SlurmError) as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False)
            return 2 if isinstance(e, LookupError) else 1
        stored = slurm_state.read_launch(target.number)
        if stored is None:
            console.print(
                f"[bold red]error:[/] revision {target.number} did not run as a Slurm job: nothing to roll"
            )
            return 2
        applied = when(target.started_at)
        console.print(f"rolling back to revision {target.number} (git {target.git_short}, applied {applied})")
        origin = msgspec.structs.replace(
            target.origin, command=f"rollback {target.number}", user=getpass.getuser()
        )
        launch = msgspec.json.decode(stored, type=rollout.JobLaunch)
        try:
            return rollout.roll(launch, target.plan, origin, console, state, record)
        except SlurmError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False)
            return 1


def _revisions_of(revisions: list[Revision]) -> dict[str, int]:
    """Process name -> the revision its run belongs to: the newest applied one that started or
    changed it (a rolled-back revision gave it its previous launch back; one in progress counts
    once it is done)."""
    out: dict[str, int] = {}
    for revision in revisions:
        if revision.outcome != "rolling" and not revision.rolled_back:
            out |= {line.split()[1]: revision.number for line in revision.changes if line[:2] in ("+ ", "~ ")}
    return out


def down(state: StateDir, console: Console) -> int:
    slurm_state = SlurmState(state)
    record = slurm_state.job()
    assert record is not None, "SlurmTarget.has_record() said so"
    with state.lock():
        try:
            job_state, _ = job.job_state(record.job_id)
            if job_state not in job.ACTIVE:
                console.print(f"graph {state.root.name} is not running (job {record.job_id}: {job_state})")
                return 0
            job.cancel(record.job_id)
            ended = job.wait_ended(record.job_id, CANCEL_TIMEOUT_S)
            left = job.steps(record.job_id)
        except SlurmError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False)
            return 1
    if not ended or left:
        console.print(
            f"[bold red]error:[/] Slurm job {record.job_id} did not end in {CANCEL_TIMEOUT_S:g} s; "
            f"steps still listed: {', '.join(left) or '-'}"
        )
        return 1
    console.print(f"graph {state.root.name}: cancelled Slurm job {record.job_id}; no step of it is left")
    return 0
