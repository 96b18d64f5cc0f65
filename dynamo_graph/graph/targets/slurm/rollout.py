"""`up --target slurm` on a graph whose job runs: a change within the job's allocation rolls its
steps; one that needs another allocation is refused, with the reason, and the job left alone.

The job's plan (the state dir's, filled with what the job resolved) and the new one are compared
by launch identity (local/changes.py), as the local target does. Within the allocation are the
command lines, env and engine args of processes that stay on their node with their GPUs and
ports. Anything else needs a new job: processes added or removed (replicas, components), a
process on another host, other GPUs or ports, the job's sbatch options, etcd / nats / a static
worker (what depends on them connected to them), restart policies, dependencies, secret values
(the job reads them from the environment sbatch gave it).

Each changed process is replaced on its own (the ranks of a multi-node replica together), in
dependency order: its new launch is written to
`slurm/job/steps/<name>.cmd` (with its engine-args file), `<name>.replace` asks the job script's
`run_step` to start the next run at once whatever its restart policy, and SIGTERM to that step
only (`scancel --signal=TERM JOB.STEP`) ends the old run, which drains like any retired worker.
The next process waits until the new run, known by the md5 of its launch in its `start` event,
is ready. A run that exits or misses its readiness timeout stops the rollout: that process and
those already replaced get their previous launch back the same way, newest first, and `up`
exits 1 with the failing process's last log lines. The replicas not being replaced serve
meanwhile, so a worker component with two or more replicas loses no request; a component of
one waits for its new run (the frontends wait `limits.model_wait_s` for a model's workers), and a
frontend's port is closed while its step restarts.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from rich.console import Console

from dynamo_graph.graph.plan import Plan, ProcessSpec
from dynamo_graph.graph.targets.local.changes import PlanChanges, plan_changes
from dynamo_graph.graph.targets.local.logs import tail_lines
from dynamo_graph.graph.targets.local.process import START_MARKER
from dynamo_graph.graph.targets.local.revisions import Origin, RevisionStore
from dynamo_graph.graph.targets.local.rollout import dependency_order
from dynamo_graph.graph.targets.local.state import StateDir, atomic_write
from dynamo_graph.graph.targets.slurm import job
from dynamo_graph.graph.targets.slurm.job import JobRecord, SlurmState
from dynamo_graph.graph.targets.slurm.script import fill_plan, launches, render_slurm, slurm_plan
from dynamo_graph.redact import is_secret_name

if TYPE_CHECKING:
    from dynamo_graph.graph.build import Built

POLL_S = 0.2
JOB_CHECK_EVERY = 10  # polls between asking Slurm whether the job still runs
STOP_MARGIN_S = 15.0  # past a process's shutdown grace: srun sees its task end, run_step starts the next
READY_MARGIN_S = 10.0  # past its readiness timeout: the probe's own `unready` comes first
FAILURE_LOG_LINES = 20
_GRES = re.compile(r"--gres=\S+")
_FIXED = re.compile(r"^(#SBATCH |PY_\d+=)")  # the allocation, and each node's interpreter


def launch_hash(launch: str) -> str:
    """What the job script writes in a run's `start` event: the md5 of the `.cmd` it read."""
    return hashlib.md5(launch.rstrip("\n").encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Launch:
    """What one process runs as: its `.cmd` text and the files its command line names."""

    text: str
    files: dict[str, str]


def _launch_of(spec: ProcessSpec, text: str, files: Mapping[str, str]) -> Launch:
    return Launch(text, {arg: files[arg] for arg in spec.argv if arg in files})


def needs_new_job(
    old: Plan,
    new: Plan,
    old_text: Mapping[str, str],
    new_text: Mapping[str, str],
    old_script: str,
    new_script: str,
    changes: PlanChanges,
) -> list[str]:
    """Why the new plan cannot run in the job's allocation (empty: it can), one reason a line,
    naming the processes and what changed. Plans are filled (fill_plan) with the job's values."""
    reasons = []
    if changes.added:
        reasons.append(f"{', '.join(changes.added)}: new processes need tasks the job was not given")
    if changes.removed:
        reasons.append(f"{', '.join(changes.removed)}: removed processes would leave the job's tasks idle")
    before, after = _fixed(old_script), _fixed(new_script)
    if before != after:
        changed = [
            f"{k} {before.get(k, '(none)')} -> {after.get(k, '(none)')}"
            for k in {**before, **after}
            if before.get(k) != after.get(k)
        ]
        reasons.append(f"the job's allocation changes: {', '.join(changed)}")
    old_specs = {p.name: p for p in old.processes}
    for spec in new.processes:
        was = old_specs.get(spec.name)
        if was is None:
            continue
        why = []
        if was.host != spec.host:
            why.append(f"moves from host {was.host} to {spec.host}")
        if was.ports != spec.ports:
            why.append(f"its ports change ({_ports(was)} -> {_ports(spec)})")
        gres_before, gres_after = _GRES.findall(old_text[spec.name]), _GRES.findall(new_text[spec.name])
        if gres_before != gres_after:
            gres = f"{' '.join(gres_before) or 'none'} -> {' '.join(gres_after) or 'none'}"
            why.append(f"its step's GPUs change ({gres})")
        if _secrets(was) != _secrets(spec):
            why.append("a secret env value changes (the job has them from its environment at submission)")
        if was.restart != spec.restart:
            why.append("its restart policy changes (the job script holds it)")
        if was.depends_on != spec.depends_on:
            deps = f"{', '.join(was.depends_on) or 'none'} -> {', '.join(spec.depends_on) or 'none'}"
            why.append(f"its dependencies change ({deps})")
        if spec.name in changes.in_place and not why:
            why.append("it changes, and what depends on it connected to it: it cannot be replaced alone")
        if why:
            reasons.append(f"{spec.name}: {'; '.join(why)}")
    return reasons


def _fixed(script: str) -> dict[str, str]:
    """The script's sbatch options (`--time` -> `30:00`) and nodes' interpreters (`PY_0` -> path)."""
    out: dict[str, str] = {}
    for line in script.splitlines():
        if _FIXED.match(line):
            words = shlex.split(line.removeprefix("#SBATCH "))
            name, _, value = words[0].partition("=") if words else ("", "", "")
            value = value or "set"  # a flag: `--exclusive`
            out[name] = f"{out[name]} {value}" if name in out else value
    return out


def _ports(spec: ProcessSpec) -> str:
    return ", ".join(f"{k.removeprefix(spec.name + '.')} {v}" for k, v in spec.ports.items()) or "none"


def _secrets(spec: ProcessSpec) -> dict[str, str]:
    return {k: v for k, v in spec.env.items() if is_secret_name(k) and v}


class Roller:
    """Replaces one step at a time in a running job (see the module docstring)."""

    def __init__(self, slurm_state: SlurmState, job_id: str) -> None:
        self.slurm_state = slurm_state
        self.job_id = job_id
        self.steps = slurm_state.job_dir / "steps"

    def replace(self, batch: Sequence[tuple[ProcessSpec, Launch]]) -> tuple[str, str] | None:
        """Run each process of `batch` with its launch instead of what it runs, all at once (a
        multi-node replica's ranks: they meet at a new rendezvous); None once every new run is
        ready, else the name of the first that failed and why."""
        since = {}
        for spec, launch in batch:  # every `.replace` before any stop: no rank's end takes the others down
            since[spec.name] = len(self.slurm_state.events(spec.name))
            for path, text in launch.files.items():
                atomic_write(Path(path), text)
            atomic_write(self.steps / f"{spec.name}.cmd", launch.text.rstrip("\n") + "\n")
            (self.steps / f"{spec.name}.replace").touch()
        steps = job.steps(self.job_id)
        old_steps: dict[str, str | None] = {}
        for spec, _ in batch:
            events = self.slurm_state.events(spec.name)
            running = not events or events[-1][0] != "exit"  # else run_step is between runs: it reads it
            step = steps.get(spec.name)
            old_steps[spec.name] = step.split()[0] if running and step is not None else None
            if (step_id := old_steps[spec.name]) is not None:
                job.signal_step(step_id, "TERM")
        for spec, launch in batch:
            want = launch_hash(launch.text)
            if (failure := self._await_ready(spec, want, since[spec.name], old_steps[spec.name])) is not None:
                return spec.name, failure
        return None

    def _await_ready(self, spec: ProcessSpec, want: str, since: int, old_step: str | None) -> str | None:
        """Until the run that started with `want` is ready (None) or failed (why). An old run
        still there after its shutdown grace is killed (SIGKILL), as the local supervisor does."""
        start_by = time.monotonic() + spec.shutdown_grace_s + spec.restart.backoff_max_s + STOP_MARGIN_S
        ready_by: float | None = None
        polls = 0
        while True:
            events = self.slurm_state.events(spec.name)[since:]
            starts = [i for i, e in enumerate(events) if e[0] == "start" and e[3:4] == [want]]
            if starts:
                ready_by = ready_by or time.monotonic() + spec.readiness.timeout_s + READY_MARGIN_S
                run = events[starts[-1] + 1 :]
                kinds = [e[0] for e in run]
                if "ready" in kinds:
                    return None
                if "exit" in kinds:
                    rc = next(e[1] for e in run if e[0] == "exit")
                    return f"its new run ended with exit {rc} before it was ready"
                if "unready" in kinds or time.monotonic() > ready_by:
                    return f"its new run was not ready in {spec.readiness.timeout_s:g} s"
            elif time.monotonic() > start_by:
                if old_step is None:
                    return "its old run did not end, or the new one did not start, in time"
                job.signal_step(old_step, "KILL")
                old_step, start_by = None, time.monotonic() + STOP_MARGIN_S
            polls += 1
            if polls % JOB_CHECK_EVERY == 0 and job.job_state(self.job_id)[0] not in job.ACTIVE:
                return f"job {self.job_id} ended"
            time.sleep(POLL_S)

    def tail(self, name: str) -> list[str]:
        """The last log lines of the process's newest run (the failed one)."""
        lines = tail_lines(self.slurm_state.state.log_file(name), FAILURE_LOG_LINES)
        starts = [i for i, line in enumerate(lines) if line.startswith(START_MARKER)]
        return [f"  {name} | {line}" for line in lines[starts[-1] if starts else 0 :]]


class JobLaunch(msgspec.Struct):
    """What a revision runs as in a job: its plan compiled for Slurm (placeholders), the sbatch
    script and each process's launch. Kept per revision (SlurmState.write_launch), so that
    `rollback` applies a revision's own launches without the graph file it came from."""

    plan: Plan
    script: str
    launches: dict[str, str]


def job_launch(built: Built) -> JobLaunch:
    """The launch of a compiled graph. Raises GraphError without a `slurm:` section."""
    script = render_slurm(built.graph, built.plan)
    placeholders = slurm_plan(built.graph, built.plan)
    return JobLaunch(placeholders, script, launches(built.graph, placeholders))


def roll(
    target: JobLaunch, compiled: Plan, origin: Origin, console: Console, state: StateDir, record: JobRecord
) -> int:
    """Apply `target` (of the plan `compiled`, as `history` records it) to the running job
    `record`: 0 rolled (or nothing to do), 1 refused or rolled back. The caller holds the state
    dir's lock."""
    slurm_state = SlurmState(state)
    graph_file = compiled.graph_file
    placeholders, new_script, new_text = target.plan, target.script, target.launches
    job_state, _ = job.job_state(record.job_id)
    running_plan, resolved = state.read_plan(), slurm_state.resolved()
    if job_state != "RUNNING" or running_plan is None or resolved is None:
        console.print(
            f"[bold red]error:[/] graph {compiled.graph} is Slurm job {record.job_id}, "
            f"{job_state or 'gone'} and not yet running its steps: nothing to roll; "
            f"`dyngraph down {graph_file}`, then `up` again"
        )
        return 1
    old, new = fill_plan(running_plan, resolved), fill_plan(placeholders, resolved)
    old_specs = {p.name: p for p in old.processes}
    if missing := [p.name for p in old.processes if slurm_state.launch(p.name) is None]:
        console.print(
            f"[bold red]error:[/] Slurm job {record.job_id} has no launch files for {', '.join(missing)} "
            f"(submitted by an older dyngraph): `dyngraph down {graph_file}`, then `up` again"
        )
        return 1
    old_text = {p.name: slurm_state.launch(p.name) or "" for p in old.processes}
    changes = plan_changes(old_specs, old.files, new, set())
    reasons = needs_new_job(old, new, old_text, new_text, slurm_state.script.read_text(), new_script, changes)
    if reasons:
        console.print(
            f"[bold red]error:[/] graph {new.graph} runs as Slurm job {record.job_id}, and this change needs "
            "a new allocation:"
        )
        for reason in reasons:
            console.print(f"  {reason}", highlight=False, markup=False)
        console.print(f"the job is unchanged; `dyngraph down {graph_file}`, then `up` again", highlight=False)
        return 1
    records = job.records(slurm_state, old, True)
    if idle := [f"{n} ({records[n].state})" for n in changes.changed if records[n].state != "ready"]:
        console.print(
            f"[bold red]error:[/] {', '.join(idle)}: only a step that runs ready can be rolled; the job is "
            f"unchanged; `dyngraph down {graph_file}`, then `up` again"
        )
        return 1
    if not changes.changed:
        _adopt(state, new, new_script, new_text, old_text)
        console.print(f"graph {new.graph}: Slurm job {record.job_id} runs this already; nothing to roll")
        return 0
    store = RevisionStore(state.revisions)
    revision = store.begin(origin, compiled, changes.lines())
    slurm_state.write_launch(revision.number, msgspec.json.encode(target))
    roller = Roller(slurm_state, record.job_id)
    new_specs = {p.name: p for p in new.processes}
    done: list[list[str]] = []
    for names in _batches(new, changes.changed):
        name = ", ".join(names)
        console.print(
            f"~ {name}: replacing {'its step' if len(names) == 1 else 'their steps together'}",
            highlight=False,
        )
        started = time.monotonic()
        batch = [(new_specs[n], _launch_of(new_specs[n], new_text[n], new.files)) for n in names]
        try:
            failed = roller.replace(batch)
        except KeyboardInterrupt:  # the job must not be left running a mix that no plan describes
            failed = names[0], "interrupted (Ctrl-C); rolling back"
        if failed is not None:
            message = f"{failed[0]} failed ({failed[1]}); last log lines:"
            console.print(f"[bold red]revision {revision.number} failed:[/] {message}", highlight=False)
            tail = roller.tail(failed[0])
            for line in tail:
                console.print(line, highlight=False, markup=False)
            back = _roll_back(roller, console, old_specs, old_text, old.files, [*done, names])
            store.finish(revision, "failed", "\n".join([message, *tail]), rolled_back=back)
            return 1
        store.progress(revision, f"{name} replaced")
        console.print(f"  {name} ready in {time.monotonic() - started:.1f} s", highlight=False)
        done.append(names)
    _adopt(state, new, new_script, new_text, old_text)
    store.finish(revision, "ready")
    rolled = f"{sum(map(len, done))} steps of Slurm job {record.job_id} rolled"
    console.print(f"graph {new.graph}: revision {revision.number}, {rolled}", highlight=False)
    return 0


def _adopt(
    state: StateDir, new: Plan, script: str, new_text: Mapping[str, str], old_text: Mapping[str, str]
) -> None:
    """The new plan is the job's: `status`, `logs`, `down` and the next `up` read it. A launch
    that differs in its probe only is written too, for the step's next start."""
    slurm_state = SlurmState(state)
    for name, text in new_text.items():
        if old_text[name] != text:
            atomic_write(slurm_state.job_dir / "steps" / f"{name}.cmd", text + "\n")
    state.write_plan(new)
    slurm_state.write_script(script)


def _batches(plan: Plan, changed: Sequence[str]) -> list[list[str]]:
    """The steps to replace, in dependency order: a process alone, or every rank of a multi-node
    replica together (one rank of it changed, all meet again at a new rendezvous)."""
    specs = {p.name: p for p in plan.processes}
    keys = dict.fromkeys(specs[n].group or n for n in dependency_order(plan, changed))
    ranks = {key: [p.name for p in plan.processes if p.group == key] for key in keys}
    return [ranks[key] or [key] for key in keys]


def _roll_back(
    roller: Roller,
    console: Console,
    old: Mapping[str, ProcessSpec],
    old_text: Mapping[str, str],
    old_files: Mapping[str, str],
    batches: list[list[str]],
) -> bool:
    """Give the batches' processes their previous launch back, newest batch first; whether every
    one is ready again."""
    ok = True
    for names in reversed(batches):
        failed = roller.replace([(old[n], _launch_of(old[n], old_text[n], old_files)) for n in names])
        if failed is not None:
            console.print(f"[bold red]rolling back {failed[0]} failed too:[/] {failed[1]}", highlight=False)
            ok = False
    if ok:
        names = [n for batch in reversed(batches) for n in batch]
        console.print(f"rolled back: {', '.join(names)} on the previous launch again")
    return ok
