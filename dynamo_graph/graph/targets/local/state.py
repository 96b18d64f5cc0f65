"""The state dir of one graph (`<graph dir>/.dyngraph/<stem>/`): what `up` leaves for `status`,
`logs` and `down`, and for the next `up`.

    plan.json          the running plan, ports filled (written by the supervisor on every apply)
    resolved.yaml      the resolved graph the plan came from (written by `up`)
    ports.json         port name -> port, kept for the whole life of the supervisor
    supervisor.pid     "<pid> <start ticks>" of the running supervisor
    supervisor.log     the detached supervisor's own output
    control.sock       the supervisor's control socket (see control.py)
    processes.json     one ProcessRecord per process, rewritten on every state change
    up.lock            flock held by an `up` or `down` while it changes the graph
    logs/<name>.log    each process's stdout + stderr, appended across restarts
    revisions/         every applied plan and how its rollout ended (revisions.py)

Every file is written atomically (temp file + rename) so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

from dynamo_graph.graph.paths import state_dir
from dynamo_graph.graph.plan import LOCAL, Plan
from dynamo_graph.graph.targets.local.process import pid_alive, pid_start_ticks

# reconnecting: on a remote host whose connection was lost; still running there, being re-attached.
ProcState = Literal["starting", "ready", "reconnecting", "restarting", "exited", "failed", "stopped"]
_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux; keep a margin


class ProcessRecord(msgspec.Struct):
    """What `status` shows for one process; `start_ticks` lets `down` verify a pid before signalling."""

    name: str
    component: str
    replica: int
    host: str
    state: ProcState = "starting"
    pid: int | None = None
    start_ticks: int | None = None
    restarts: int = 0
    started_at: float | None = None  # wall clock of the current run's start
    last_exit: int | None = None  # return code; negative: killed by that signal
    message: str = ""
    revision: int = 0  # the graph revision this run belongs to (revisions.py)
    retiring: bool = False  # an old run a rollout is replacing: out of routing, finishing its streams


def record_alive(record: ProcessRecord) -> bool:
    """A local process by its verified pid; a remote one as its supervisor last recorded it (a
    remote pid means nothing here)."""
    if record.host != LOCAL:
        return record.state in ("starting", "ready", "reconnecting")
    return record.pid is not None and pid_alive(record.pid, record.start_ticks)


class SupervisorPid(msgspec.Struct):
    pid: int
    start_ticks: int


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via a temp file in the same folder and rename, so readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class StateDir:
    """Paths and typed reads/writes of one graph's state dir."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.logs = self.root / "logs"
        self.plan_file = self.root / "plan.json"
        self.resolved_file = self.root / "resolved.yaml"
        self.ports_file = self.root / "ports.json"
        self.pid_file = self.root / "supervisor.pid"
        self.supervisor_log = self.root / "supervisor.log"
        self.processes_file = self.root / "processes.json"
        self.lock_file = self.root / "up.lock"
        self.revisions = self.root / "revisions"

    @classmethod
    def of(cls, graph_file: str | Path) -> StateDir:
        """A graph file's state dir; `status`, `logs` and `down` need no valid graph, only its path."""
        return cls(state_dir(graph_file))

    @property
    def control_socket(self) -> Path:
        """`control.sock` in the state dir, or a hashed name in the runtime dir when that path would
        not fit in a unix socket address."""
        path = self.root / "control.sock"
        if len(str(path)) <= _SUN_PATH_MAX:
            return path
        runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
        return runtime / f"dyngraph-{hashlib.sha1(str(self.root).encode()).hexdigest()[:16]}.sock"

    def log_file(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def ensure(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Serialize `up`/`down` on one graph: the second waits for the first to finish."""
        self.ensure()
        with self.lock_file.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ---- supervisor pid --------------------------------------------------------------------

    def write_pid(self, pid: int) -> None:
        ticks = pid_start_ticks(pid)
        assert ticks is not None, "our own pid has a start time"
        atomic_write(self.pid_file, msgspec.json.encode(SupervisorPid(pid, ticks)))

    def supervisor(self) -> SupervisorPid | None:
        """The running supervisor, or None when there is none (no file, or its pid is gone or reused)."""
        try:
            sup = msgspec.json.decode(self.pid_file.read_bytes(), type=SupervisorPid)
        except (FileNotFoundError, msgspec.DecodeError):
            return None
        return sup if pid_alive(sup.pid, sup.start_ticks) else None

    # ---- plan, ports, processes --------------------------------------------------------------

    def write_plan(self, plan: Plan) -> None:
        atomic_write(self.plan_file, msgspec.json.format(msgspec.json.encode(plan)))

    def read_plan(self) -> Plan | None:
        try:
            return msgspec.json.decode(self.plan_file.read_bytes(), type=Plan)
        except FileNotFoundError:
            return None

    def write_ports(self, ports: dict[str, int]) -> None:
        atomic_write(self.ports_file, msgspec.json.format(msgspec.json.encode(dict(sorted(ports.items())))))

    def read_ports(self) -> dict[str, int]:
        try:
            return msgspec.json.decode(self.ports_file.read_bytes(), type=dict[str, int])
        except FileNotFoundError:
            return {}

    def write_processes(self, records: list[ProcessRecord]) -> None:
        atomic_write(self.processes_file, msgspec.json.format(msgspec.json.encode(records)))

    def read_processes(self) -> list[ProcessRecord]:
        try:
            return msgspec.json.decode(self.processes_file.read_bytes(), type=list[ProcessRecord])
        except FileNotFoundError:
            return []

    def clear_runtime_files(self) -> None:
        """Forget the supervisor (pid and socket); plan, processes and logs stay for inspection."""
        for path in (self.pid_file, self.control_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
