"""Slurm's command line as dyngraph uses it (sbatch, squeue, scontrol, scancel), and what the job
of a graph leaves in the state dir, read back as the supervisor's process records.

The cluster is the one the environment names (SLURM_CONF, or the client's default): dyngraph
starts no daemon. Accounting (sacct) is often off, and squeue forgets a job soon after it ends,
so the processes' states come from the events the job script writes (script.py) and the job's
own state from squeue, then `scontrol show job`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import msgspec

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local.state import ProcessRecord, StateDir, atomic_write
from dynamo_graph.graph.targets.slurm.script import JOB_DIR

ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED"})
COMMAND_TIMEOUT_S = 30.0


class SlurmError(Exception):
    """A Slurm command that is missing or failed; the message says which and why."""


class JobRecord(msgspec.Struct):
    """`slurm/job.json`: the job a graph runs as."""

    job_id: str
    script: str
    submitted_at: float


def slurm(*argv: str, env: dict[str, str] | None = None, check: bool = True) -> str:
    """Run a Slurm client command; its stdout. Raises SlurmError when it is missing or fails."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` is not installed here: the Slurm target needs Slurm's client commands")
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer in {COMMAND_TIMEOUT_S:g} s") from None
    if check and done.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


class SlurmState:
    """The Slurm part of a graph's state dir."""

    def __init__(self, state: StateDir) -> None:
        self.state = state
        self.root = state.root / "slurm"
        self.job_file = self.root / "job.json"
        self.script = self.root / "job.sbatch"
        self.job_dir = state.root / JOB_DIR

    def job(self) -> JobRecord | None:
        try:
            return msgspec.json.decode(self.job_file.read_bytes(), type=JobRecord)
        except FileNotFoundError:
            return None

    def write_job(self, record: JobRecord) -> None:
        atomic_write(self.job_file, msgspec.json.encode(record))

    def write_script(self, text: str) -> None:
        atomic_write(self.script, text)
        self.script.chmod(0o700)

    def resolved(self) -> dict[str, str] | None:
        """The nodes' names and addresses and the ports the job picked, once it has."""
        try:
            text = (self.job_dir / "resolved.env").read_text()
        except FileNotFoundError:
            return None
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def events(self, name: str) -> list[list[str]]:
        try:
            return [line.split() for line in (self.job_dir / "steps" / name).read_text().splitlines()]
        except FileNotFoundError:
            return []

    def launch(self, name: str) -> str | None:
        """The launch a process's next run takes (`steps/<name>.cmd`, script.py)."""
        try:
            return (self.job_dir / "steps" / f"{name}.cmd").read_text().rstrip("\n")
        except FileNotFoundError:
            return None

    def write_launch(self, revision: int, encoded: bytes) -> None:
        """A revision's JobLaunch (rollout.py), for `rollback`."""
        atomic_write(self.root / "revisions" / f"{revision:06d}.json", encoded)

    def read_launch(self, revision: int) -> bytes | None:
        try:
            return (self.root / "revisions" / f"{revision:06d}.json").read_bytes()
        except FileNotFoundError:
            return None

    def off(self, name: str) -> bool:
        """The process is not to run: a standby replica, or one the planner retired (script.py)."""
        return (self.job_dir / "steps" / f"{name}.off").exists()

    def finished(self, name: str) -> bool:
        """The script is done with the process (no more restarts)."""
        return (self.job_dir / "steps" / f"{name}.done").exists()


def submit(script: Path, secrets: dict[str, str]) -> str:
    """sbatch the script (secret values reach the job through sbatch's environment); the job id."""
    out = slurm("sbatch", "--parsable", str(script), env={**os.environ, **secrets})
    return out.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str | None, str]:
    """(state, reason) of a job: RUNNING, PENDING, ... or None when Slurm no longer knows it."""
    out = slurm("squeue", "-h", "-j", job_id, "-o", "%T|%r", check=False).strip()
    if out:
        state, _, reason = out.partition("|")
        return state, reason
    shown = slurm("scontrol", "-o", "show", "job", job_id, check=False)
    fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
    return fields.get("JobState"), fields.get("Reason", "")


def steps(job_id: str) -> dict[str, str]:
    """Step name -> `STEPID STATE` of the job's running steps."""
    out = slurm("squeue", "-h", "-s", "-j", job_id, "-O", "StepId:|,StepName:|,StepState:|", check=False)
    running = {}
    for line in out.splitlines():
        if line.count("|") < 3:
            continue
        step_id, name, state = (part.strip() for part in line.split("|")[:3])
        running[name] = f"{step_id} {state}"
    return running


def cancel(job_id: str) -> None:
    slurm("scancel", job_id)


def signal_step(step_id: str, signal_name: str) -> None:
    """Signal one step's tasks (not the job's other steps); a step that just ended is no error."""
    slurm("scancel", f"--signal={signal_name}", step_id, check=False)


def wait_ended(job_id: str, timeout_s: float) -> bool:
    """True once the job is no longer active (or unknown), within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = job_state(job_id)
        if state not in ACTIVE and not steps(job_id):
            return True
        time.sleep(0.2)
    return False


def records(slurm_state: SlurmState, plan: Plan, job_active: bool) -> dict[str, ProcessRecord]:
    """The processes' states from the job's events, as the supervisor would record them."""
    out = {}
    restart_never = {p.name: p.restart.policy == "never" for p in plan.processes}
    for proc in plan.processes:
        record = ProcessRecord(proc.name, proc.component, proc.replica, proc.host)
        events = slurm_state.events(proc.name)
        # a rollout's new run, and a standby replica's first, start afresh
        afresh = [i for i, e in enumerate(events) if e[0] in ("replace", "off")]
        events = events[afresh[-1] + 1 :] if afresh else events
        starts = [i for i, e in enumerate(events) if e[0] == "start"]
        exits = [e for e in events if e[0] == "exit"]
        record.restarts = max(len(starts) - 1, 0)
        record.last_exit = int(exits[-1][1]) if exits else None
        current = events[starts[-1] :] if starts else events
        kinds = [e[0] for e in current]
        if starts:
            record.started_at = float(events[starts[-1]][1])
        if "blocked" in kinds:
            record.state, record.message = "failed", f"{current[-1][2]} never became ready"
        elif "crashloop" in kinds:
            record.state = "failed"
            record.message = f"ran {len(starts)} times, last exit {_exit(record.last_exit)} (restart policy)"
        elif "exit" in kinds:
            done = slurm_state.finished(proc.name) or restart_never[proc.name]
            record.state = ("exited" if record.last_exit == 0 else "failed") if done else "restarting"
            record.message = f"step ended with exit {_exit(record.last_exit)}"
            if downs := [e for e in current if e[0] == "down"]:
                record.message += f", taken down with its group ({downs[0][2]} ended)"
        elif "unready" in kinds:
            record.state, record.message = "failed", f"not ready in {proc.readiness.timeout_s:g} s"
        elif "ready" in kinds:
            record.state = "ready"
        if record.state in ("starting", "ready") and exits:
            record.message = f"restarted after exit {_exit(record.last_exit)}"
            last_run = events[starts[-2] : starts[-1]] if len(starts) > 1 else []
            if downs := [e for e in last_run if e[0] == "down"]:  # its group went down (script.py)
                record.message = f"restarted with its group after {downs[0][2]} ended"
        if not job_active and record.state in ("starting", "ready", "restarting"):
            record.state = "stopped"
        out[proc.name] = record
    return out


def running_plan(slurm_state: SlurmState, plan: Plan) -> Plan:
    """The plan with the processes the job runs now: an autoscaled pool's standby replicas that
    its planner started (their launch written, no `.off`), less the replicas it retired."""
    every = [*plan.processes, *plan.standby]
    standby = {p.name for p in plan.standby}
    on = [
        p
        for p in every
        if not slurm_state.off(p.name) and (p.name not in standby or slurm_state.launch(p.name) is not None)
    ]
    names = {p.name for p in on}
    return msgspec.structs.replace(plan, processes=on, standby=[p for p in every if p.name not in names])


def _exit(code: int | None) -> str:
    """srun's exit code, with the signal that killed the task (128 + N) named."""
    try:
        name = signal.Signals(code - 128).name if code is not None and code > 128 else None
    except ValueError:
        name = None
    return f"{code} ({name})" if name else str(code)
