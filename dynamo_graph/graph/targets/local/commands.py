"""`dyngraph up | status | logs | down`: the client side of the supervisor; each returns an exit code.

`up -d` starts a detached supervisor when none runs (or reuses the running one), sends it the
plan over the control socket (see DetachedUp), and waits on processes.json until every process
is ready or one failed. `down` asks the supervisor to stop, waits for it to exit, then checks for itself that
no process of the graph is alive and none of its ports is still listening: local processes by
verified pid, remote hosts by asking each (over ssh) for processes tagged with the graph's id.
A remote pid means nothing here, so local pid checks only ever look at records of `local`.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from dynamo_graph.graph.plan import LOCAL, Plan
from dynamo_graph.graph.targets.local import control, probes, registry
from dynamo_graph.graph.targets.local.daemon import supervise
from dynamo_graph.graph.targets.local.history import (
    autoscale_decisions,
    autoscale_lines,
    revision_lines,
    status_document,
    when,
)
from dynamo_graph.graph.targets.local.logs import LogFollower, interleaved, tail_lines
from dynamo_graph.graph.targets.local.ports import listening, plan_ports
from dynamo_graph.graph.targets.local.process import START_MARKER, kill_verified, pid_alive
from dynamo_graph.graph.targets.local.revisions import (
    Origin,
    Revision,
    RevisionStore,
    origin_of,
    rollback_target,
)
from dynamo_graph.graph.targets.local.state import ProcessRecord, StateDir, record_alive
from dynamo_graph.graph.targets.local.supervisor import Supervisor
from dynamo_graph.graph.targets.local.ui import Prefixer, frontend_url, status_table

if TYPE_CHECKING:
    from dynamo_graph.graph.build import Built  # the graph loader: imported by the CLI when needed

DAEMON_START_TIMEOUT_S = 15.0
FAILURE_LOG_LINES = 20
POLL_S = 0.02
ATTACH_POLL_S = 0.1


# ---- up ---------------------------------------------------------------------------------------


def _write_resolved(state: StateDir, built: Built) -> None:
    import yaml

    state.ensure()
    text = yaml.safe_dump(built.graph.model_dump(mode="json"), sort_keys=False, width=120)
    state.resolved_file.write_text(text)


def _levels(plan: Plan) -> int:
    """How many dependency levels the plan has (processes that start one after another)."""
    deps = {p.name: p.depends_on for p in plan.processes}
    level: dict[str, int] = {}

    def of(name: str) -> int:  # the validator rejects cycles
        if name not in level:
            level[name] = 1 + max((of(d) for d in deps.get(name, [])), default=0)
        return level[name]

    return max((of(n) for n in deps), default=1)


def wait_deadline(plan: Plan) -> float:
    """Enough for each dependency level to use its readiness timeout, plus a margin."""
    longest = max((p.readiness.timeout_s for p in plan.processes), default=0.0)
    return time.monotonic() + longest * _levels(plan) + 10.0


def _wait_revision(state: StateDir, number: int, console: Console) -> Revision:
    """Poll the revision's file until its rollout ended (every step of it is bounded by the
    processes' readiness timeouts), printing the steps it records (a canary's). Raises
    ControlError if the supervisor died meanwhile."""
    store = RevisionStore(state.revisions)
    shown = 0
    while True:
        revision = store.read(number)
        if revision is not None:
            for line in revision.progress[shown:]:
                console.print(line, highlight=False)
            shown = len(revision.progress)
            if revision.outcome != "rolling":
                return revision
        if state.supervisor() is None:
            raise control.ControlError("the supervisor exited; see " + str(state.supervisor_log))
        time.sleep(POLL_S)


def apply_and_wait(state: StateDir, plan: Plan, origin: Origin, console: Console, started: float) -> int:
    """Send `plan` to the running supervisor and follow its rollout: 0 once every process of
    the revision is ready, 1 when it failed (then rolled back, unless it was the first)."""
    try:
        reply = control.request(state.control_socket, control.Apply(plan, origin))
    except control.ControlError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 1
    for change in reply.changes:
        console.print(change, highlight=False)
    try:
        revision = _wait_revision(state, reply.revision, console)
    except control.ControlError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 1
    if revision.outcome == "failed":
        console.print(f"[bold red]revision {revision.number} failed:[/] {revision.message}", highlight=False)
        if revision.rolled_back:
            console.print(f"rolled back: the graph serves its previous revision ({plan.graph})")
        else:
            console.print(f"the rest keeps running; stop it with `dyngraph down {plan.graph_file}`")
        return 1
    running = state.read_plan() or plan  # as the supervisor filled its `auto` ports
    console.print(status_table(running, {r.name: r for r in state.read_processes()}, None))
    for spec in running.processes:
        if url := frontend_url(spec):
            console.print(f"{spec.name}: {url}", highlight=False)
    elapsed = time.monotonic() - started
    what = "no changes" if not reply.changes else f"{len(running.processes)} processes ready"
    console.print(f"graph {plan.graph} revision {revision.number}: {what} in {elapsed:.2f} s")
    return 0


class DetachedUp:
    """`up -d` in two halves, so that a new supervisor boots while the graph is being loaded:

        with DetachedUp(state) as up:      # lock the graph; spawn a supervisor if none runs
            code = up.run(build(...), console)

    Leaving the block by an exception (a graph with errors) stops a supervisor spawned here.
    """

    def __init__(self, state: StateDir) -> None:
        self.state = state
        self.daemon: subprocess.Popen[bytes] | None = None
        self.orphans: list[str] = []  # processes of a dead supervisor that would not stop
        self._lock = state.lock()

    def __enter__(self) -> DetachedUp:
        self.started = time.monotonic()
        self._lock.__enter__()
        if self.state.supervisor() is not None:
            return self
        self.orphans = _reap_orphans(self.state)
        if self.orphans:
            return self
        with self.state.supervisor_log.open("ab") as log:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "dynamo_graph.graph.targets.local.daemon", str(self.state.root)],
                cwd=self.state.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is not None and self.daemon is not None:
                self.daemon.terminate()  # our own child: it stops its (empty) plan and exits
                self.daemon.wait(DAEMON_START_TIMEOUT_S)
        finally:
            self._lock.__exit__(*exc)

    def _wait_daemon(self) -> None:
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while not control.reachable(self.state.control_socket):
            assert self.daemon is not None
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(tail_lines(self.state.supervisor_log, FAILURE_LOG_LINES))
                raise control.ControlError(f"the supervisor did not start:\n{tail}")
            time.sleep(0.005)

    def run(self, built: Built, console: Console) -> int:
        """Preflight, send the plan, wait until every process is ready (0) or one failed (1).
        Raises GraphError when preflight finds problems (a supervisor spawned here then stops)."""
        plan, state = built.plan, self.state
        if self.orphans:
            console.print(f"[bold red]error:[/] processes of a previous run would not stop: {self.orphans}")
            return 1
        preflight(built, check_ports=self.daemon is not None)  # a fresh supervisor: no port is ours yet
        _write_resolved(state, built)
        try:
            if self.daemon is not None:
                self._wait_daemon()
        except control.ControlError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False)
            return 1
        return apply_and_wait(state, plan, origin_of(plan.graph_file, "up"), console, self.started)


def preflight(built: Built, *, check_ports: bool) -> None:
    """Raises GraphError (exit 2 in the CLI) with every problem of the graph's hosts."""
    from dynamo_graph.graph.targets.local.preflight import preflight as check

    loaded = built.loaded
    check(built.graph, built.plan, loaded.source, str(loaded.file), check_ports=check_ports)


def up_foreground(built: Built, console: Console) -> int:
    """Like `docker compose up`: run the supervisor here, stream prefixed logs, Ctrl-C stops all.
    On a graph already running in the background: apply the changes, then attach to it."""
    plan = built.plan
    state = StateDir(plan.state_dir)
    with state.lock():
        running = state.supervisor() is not None
        if not running:
            if orphans := _reap_orphans(state):
                console.print(f"[bold red]error:[/] processes of a previous run would not stop: {orphans}")
                return 1
            preflight(built, check_ports=True)
            _write_resolved(state, built)
            state.write_pid(os.getpid())  # claim the graph before releasing the lock
    if running:
        console.print(f"graph {plan.graph} already runs in the background: applying the changes to it")
        with DetachedUp(state) as up:
            code = up.run(built, console)
        return code or attach(state, console)
    prefix = Prefixer(console, [p.name for p in plan.processes])
    started = time.monotonic()

    async def stream(sup: Supervisor) -> None:
        follower = LogFollower(prefix.line)
        announced = False
        try:
            while True:
                for name in sup.runners:
                    follower.add(name, state.log_file(name), from_end=True)
                follower.poll()
                records = [r.record for r in sup.runners.values()]
                if not announced and records and all(r.state == "ready" for r in records):
                    announced = True
                    elapsed = time.monotonic() - started
                    prefix.event("dyngraph", f"all {len(records)} processes ready in {elapsed:.2f} s")
                    for spec in (sup.plan or plan).processes:  # `auto` ports filled
                        if url := frontend_url(spec):
                            prefix.event("dyngraph", f"{spec.name}: {url}")
                await asyncio.sleep(POLL_S)
        finally:
            follower.poll()

    asyncio.run(supervise(state, prefix.event, plan, alongside=stream))
    return 0


def attach(state: StateDir, console: Console) -> int:
    """`up` in the foreground on a graph that runs in the background: follow its processes' logs
    and the supervisor's reports until Ctrl-C, which stops the graph as `down` does (as
    `docker compose up` does), or until something else stops it."""
    plan = state.read_plan()
    names = [p.name for p in plan.processes] if plan else []
    prefix = Prefixer(console, names)
    follower = LogFollower(prefix.line)
    for name in names:
        follower.add(name, state.log_file(name), from_end=True)
    follower.add("dyngraph", state.supervisor_log, from_end=True)
    console.print("attached to its logs; Ctrl-C stops the graph (`dyngraph up -d` leaves it running)")
    try:
        while state.supervisor() is not None:
            follower.poll()
            time.sleep(ATTACH_POLL_S)
    except KeyboardInterrupt:
        console.print("stopping the graph (Ctrl-C)")
        return down(state, console)
    follower.poll()
    console.print("the graph was stopped")
    return 0


# ---- status -----------------------------------------------------------------------------------


def _log_since_last_start(path: Path) -> probes.LogWatch:
    """A LogWatch over the current run's output: after the last start marker in the log."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return probes.LogWatch(path, 0)
    marker = data.rfind(START_MARKER.encode())
    offset = 0 if marker < 0 else data.index(b"\n", marker) + 1
    return probes.LogWatch(path, offset)


async def _health_now(state: StateDir, plan: Plan, records: dict[str, ProcessRecord]) -> dict[str, str]:
    """Each live process's readiness probe, run once now."""

    async def one(name: str) -> str:
        spec = next(p for p in plan.processes if p.name == name)
        ok = await probes.check(spec.readiness, _log_since_last_start(state.log_file(name)))
        return f"{spec.readiness.kind} {'ok' if ok else 'failing'}"

    # A remote process's http / tcp probe only means something from its host: the supervisor runs
    # those; here they show as "-".
    live = [
        n
        for n, r in records.items()
        if record_alive(r) and (r.host == LOCAL or _probe_kind(plan, n) == "log")
    ]
    results = await asyncio.gather(*(one(n) for n in live if any(p.name == n for p in plan.processes)))
    return dict(zip(live, results, strict=False))


def status(state: StateDir, console: Console, as_json: bool = False) -> int:
    plan = state.read_plan()
    if plan is None:
        if as_json:
            console.print_json(data={"graph": None, "running": False, "state_dir": str(state.root)})
        else:
            console.print(f"graph in {state.root} has never run")
        return 0
    all_records = state.read_processes()
    records = {r.name: r for r in all_records if not r.retiring}
    retiring = [r for r in all_records if r.retiring]
    running = state.supervisor() is not None
    revisions = RevisionStore(state.revisions).all()
    decisions = autoscale_decisions(state)
    if as_json:
        console.print_json(data=status_document(plan, all_records, revisions, running, decisions))
        return 0
    health = asyncio.run(_health_now(state, plan, records)) if running else {}
    console.print(status_table(plan, records, health, retiring))
    for line in [*revision_lines(revisions), *autoscale_lines(plan, decisions, records)]:
        console.print(line, highlight=False)
    if not running:
        console.print(f"graph {plan.graph} is not running (last known states shown)")
    return 0


def rollback(state: StateDir, console: Console, number: int | None) -> int:
    """Apply a recorded revision's plan (default: the last ready one before the serving one)
    with the same rolling machinery as `up`; 2 when there is nothing to roll back to."""
    started = time.monotonic()
    with state.lock():
        if state.supervisor() is None:
            console.print(f"[bold red]error:[/] graph in {state.root} is not running; `dyngraph up` it first")
            return 2
        try:
            target = rollback_target(RevisionStore(state.revisions).all(), number)
        except LookupError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False)
            return 2
        applied = when(target.started_at)
        console.print(
            f"rolling back to revision {target.number} (git {target.git_short}, applied {applied})",
            highlight=False,
        )
        origin = Origin(
            f"rollback {target.number}",
            getpass.getuser(),
            target.origin.git_commit,
            target.origin.git_dirty,
            target.origin.git_repo,
        )
        return apply_and_wait(state, target.plan, origin, console, started)


# ---- logs -------------------------------------------------------------------------------------


def logs(state: StateDir, console: Console, selector: str | None, follow: bool, lines: int) -> int:
    plan = state.read_plan()
    names = [p.name for p in plan.processes] if plan else sorted(p.stem for p in state.logs.glob("*.log"))
    if selector:
        components = {p.name: p.component for p in plan.processes} if plan else {}
        names = [n for n in names if selector in (n, components.get(n))]
        if not names:
            console.print(f"[bold red]error:[/] no process or component named {selector!r}", highlight=False)
            return 1
    prefix = Prefixer(console, names)
    for name, line in interleaved({name: tail_lines(state.log_file(name), lines) for name in names}):
        prefix.line(name, line)
    if not follow:
        return 0
    follower = LogFollower(prefix.line)
    for name in names:
        follower.add(name, state.log_file(name), from_end=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(follower.run())
    return 0


# ---- down -------------------------------------------------------------------------------------


def _wait_gone(alive: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def down(state: StateDir, console: Console) -> int:
    if not state.root.exists():
        console.print(f"graph in {state.root} is not running")
        return 0
    with state.lock():
        plan = state.read_plan()
        records = state.read_processes()
        sup = state.supervisor()
        live = [r for r in records if record_alive(r)]
        if sup is None and not live:
            _forget_supervisor(state)
            console.print(f"graph in {state.root} is not running")
            return 0
        grace = _grace(plan)
        levels = _levels(plan) if plan else 1
        if sup is not None:
            try:
                control.request(state.control_socket, control.Stop())
            except control.ControlError:
                kill_verified(sup.pid, sup.start_ticks, signal.SIGTERM)
            if not _wait_gone(lambda: pid_alive(sup.pid, sup.start_ticks), grace * (levels + 1) + 5):
                console.print("[yellow]the supervisor did not stop in time; killing it[/]")
                kill_verified(sup.pid, sup.start_ticks, signal.SIGKILL)
        remote, unchecked = _stop_remote(state, plan, grace)
        leftovers = _stop_leftovers(records, grace) + remote
        _forget_supervisor(state)
        ports = sorted(p for p in plan_ports(plan) if listening(p)) if plan else []
    for why in unchecked:
        console.print(f"[bold red]error:[/] cannot check what is left of the graph on {why}", highlight=False)
    if unchecked and not (leftovers or ports):
        return 1
    if leftovers or ports:
        console.print(
            f"[bold red]error:[/] still alive: {', '.join(leftovers) or '-'}; "
            f"ports still listening: {', '.join(map(str, ports)) or '-'}"
        )
        return 1
    console.print(f"graph {plan.graph if plan else state.root.name}: stopped {len(live)} processes")
    return 0


def _forget_supervisor(state: StateDir) -> None:
    """Its pid and socket files, and its entry in `dyngraph ls` (left behind when it was killed)."""
    state.clear_runtime_files()
    registry.leave(state.root)


def _grace(plan: Plan | None) -> float:
    return max((p.shutdown_grace_s for p in plan.processes), default=10.0) if plan else 10.0


def _reap_orphans(state: StateDir) -> list[str]:
    """Before a fresh supervisor: stop processes a dead one left behind and forget its files.
    Returns the names of any that would not stop (then nothing may be started)."""
    plan = state.read_plan()
    # A host that cannot be reached does not block: the agents there stop what the dead supervisor
    # left once their connections are gone, and preflight reports the host if the graph still uses it.
    remote, _ = _stop_remote(state, plan, _grace(plan))
    leftovers = _stop_leftovers(state.read_processes(), _grace(plan)) + remote
    if not leftovers:
        _forget_supervisor(state)
    return leftovers


def _stop_leftovers(records: list[ProcessRecord], grace: float) -> list[str]:
    """Processes the supervisor did not stop (it crashed or was killed): SIGTERM, grace, SIGKILL.
    Returns the names of any still alive after that."""

    def alive() -> list[ProcessRecord]:
        return [r for r in records if r.host == LOCAL and record_alive(r)]

    for record in alive():
        kill_verified(record.pid, record.start_ticks, signal.SIGTERM)  # type: ignore[arg-type]
    if not _wait_gone(lambda: bool(alive()), grace):
        for record in alive():
            kill_verified(record.pid, record.start_ticks, signal.SIGKILL)  # type: ignore[arg-type]
        _wait_gone(lambda: bool(alive()), 5.0)
    return [r.name for r in alive()]


def _probe_kind(plan: Plan, name: str) -> str | None:
    return next((p.readiness.kind for p in plan.processes if p.name == name), None)


def _stop_remote(state: StateDir, plan: Plan | None, grace: float) -> tuple[list[str], list[str]]:
    """Stop what is left of the graph on each remote host (normally nothing: the agents stop
    their processes with the supervisor, or agent.REATTACH_S after it died); returns what would
    not stop and the hosts not reached."""
    if plan is None or not plan.hosts:
        return [], []
    from dynamo_graph.graph.targets.local.remote.ssh import sweep_hosts

    return asyncio.run(sweep_hosts(plan.hosts, state.root, grace))
