"""A graph's revision history: every plan `up` or `rollback` applied, where it came from, how
its rollout ended.

    revisions/NNNNNN.json   one Revision per applied plan that changed something

The supervisor is the only writer: it numbers a revision when it accepts the plan and records
the rollout's outcome (rollout.py). `up` sends the origin with the plan (the git commit of the
repository holding the graph file, whether it had uncommitted changes, who, from what command);
`history`, `status` and `rollback` read the files. A rollback applies a revision's stored plan,
not the graph file on disk, so it brings back exactly what ran.
"""

from __future__ import annotations

import getpass
import hashlib
import subprocess
import time
from pathlib import Path
from typing import Literal

import msgspec

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local.state import atomic_write

# rolling: being applied; ready: every process of it ready; failed: a new process did not prove
# itself and the change was rolled back (the previous revision serves).
Outcome = Literal["rolling", "ready", "failed"]
GIT_TIMEOUT_S = 5.0


class Origin(msgspec.Struct, frozen=True):
    """Where a plan came from, as the `up` that sent it saw it."""

    command: str  # "up", "rollback 3"
    user: str
    git_commit: str | None = None  # of the repository holding the graph file; None: not in git
    git_dirty: bool = False  # the repository had uncommitted changes to tracked files
    git_repo: str | None = None


class Revision(msgspec.Struct):
    number: int
    origin: Origin
    content_hash: str  # of the plan, so `history` shows which revisions ran the same thing
    plan: Plan  # as `up` compiled it, ports not filled: what `rollback` applies again
    changes: list[str]
    outcome: Outcome = "rolling"
    message: str = ""  # why it failed: the process, its state, its last log lines
    rolled_back: bool = False  # failed, and the previous processes serve again (not a first start)
    progress: list[str] = []  # the steps it went through (a canary's shares and what they saw)
    started_at: float = 0.0
    finished_at: float | None = None

    @property
    def git_short(self) -> str:
        if self.origin.git_commit is None:
            return "-"
        return self.origin.git_commit[:10] + ("+dirty" if self.origin.git_dirty else "")


def content_hash(plan: Plan) -> str:
    return hashlib.sha256(msgspec.json.encode(plan)).hexdigest()[:12]


def _git(folder: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def origin_of(graph_file: str | Path, command: str) -> Origin:
    """The origin of a plan compiled from `graph_file` now: its repository's HEAD and dirty flag
    (tracked files only: a stray untracked file does not make a deployment dirty)."""
    folder = Path(graph_file).resolve().parent
    user = getpass.getuser()
    commit = _git(folder, "rev-parse", "HEAD")
    if commit is None:
        return Origin(command, user)
    status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    return Origin(command, user, commit, bool(status), _git(folder, "rev-parse", "--show-toplevel"))


class RevisionStore:
    """The revisions folder of one graph's state dir."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, number: int) -> Path:
        return self.folder / f"{number:06d}.json"

    def write(self, revision: Revision) -> None:
        atomic_write(self._path(revision.number), msgspec.json.format(msgspec.json.encode(revision)))

    def read(self, number: int) -> Revision | None:
        try:
            return msgspec.json.decode(self._path(number).read_bytes(), type=Revision)
        except FileNotFoundError:
            return None

    def all(self) -> list[Revision]:
        """Oldest first."""
        return [
            msgspec.json.decode(path.read_bytes(), type=Revision)
            for path in sorted(self.folder.glob("[0-9]*.json"))
        ]

    def latest(self) -> Revision | None:
        paths = sorted(self.folder.glob("[0-9]*.json"))
        return msgspec.json.decode(paths[-1].read_bytes(), type=Revision) if paths else None

    def begin(self, origin: Origin, plan: Plan, changes: list[str]) -> Revision:
        latest = self.latest()
        revision = Revision(
            number=(latest.number if latest else 0) + 1,
            origin=origin,
            content_hash=content_hash(plan),
            plan=plan,
            changes=changes,
            started_at=time.time(),
        )
        self.write(revision)
        return revision

    def progress(self, revision: Revision, text: str) -> None:
        revision.progress.append(text)
        self.write(revision)

    def finish(
        self, revision: Revision, outcome: Outcome, message: str = "", rolled_back: bool = False
    ) -> None:
        revision.outcome = outcome
        revision.message = message
        revision.rolled_back = rolled_back
        revision.finished_at = time.time()
        self.write(revision)


def serving(revisions: list[Revision]) -> Revision | None:
    """The revision the graph serves: the newest that became ready (a failed one was rolled back)."""
    return next((r for r in reversed(revisions) if r.outcome == "ready"), None)


def rollback_target(revisions: list[Revision], number: int | None) -> Revision:
    """The revision `rollback` applies: `number`, or the last ready one before the serving one.
    Raises LookupError saying why there is none."""
    if number is not None:
        found = next((r for r in revisions if r.number == number), None)
        if found is None:
            known = ", ".join(str(r.number) for r in revisions) or "none"
            raise LookupError(f"no revision {number} (revisions: {known})")
        return found
    current = serving(revisions)
    if current is None:
        raise LookupError("no revision of this graph became ready yet: nothing to roll back to")
    earlier = [r for r in revisions if r.number < current.number and r.outcome == "ready"]
    different = [r for r in earlier if r.content_hash != current.content_hash]
    if not different:
        raise LookupError(f"revision {current.number} is the first that ran: nothing to roll back to")
    return different[-1]
