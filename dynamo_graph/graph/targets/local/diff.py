"""`dyngraph diff GRAPH` and `dyngraph up --dry-run`: what `up` would do to the running graph, per
process `+` (start), `~` (restart) or `-` (stop) with the fields that changed (secrets masked),
and each component's replicas. Exit code 0 when nothing would change, 1 when something would.

It is the supervisor's own comparison (changes.py) between the plan the running
supervisor wrote, ports filled, and the new plan filled with the same ports, so what it tells
is what `up` does. A graph that is not running would have every process started.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from dynamo_graph.graph.plan import Plan, ProcessSpec
from dynamo_graph.graph.render import redact_argv, redact_env
from dynamo_graph.graph.targets.local.changes import PlanChanges, moved_hosts, plan_changes
from dynamo_graph.graph.targets.local.ports import fill_plan
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.redact import REDACTED

if TYPE_CHECKING:  # the graph loader (Hydra): `status` and `down` load this module without it
    from dynamo_graph.graph.build import Built

_STYLE = {"+": "green", "~": "yellow", "-": "red"}


def _argv_changes(old: list[str], new: list[str]) -> Iterator[str]:
    """Each changed stretch of the command line, with the flag before it for context. Compared
    as it runs, shown redacted (a changed secret shows as `*** -> ***`)."""
    old_shown, new_shown = redact_argv(old), redact_argv(new)  # one word for each word
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        flag = old[i1 - 1] if i1 > 0 and old[i1 - 1].startswith("--") and tag != "insert" else ""
        before = " ".join([flag, *old_shown[i1:i2]]).strip()
        after = " ".join([flag, *new_shown[j1:j2]]).strip()
        if tag == "replace":
            yield f"argv: {before} -> {after}"
        elif tag == "delete":
            yield f"argv: - {before}"
        else:
            yield f"argv: + {after}"


def _env_changes(old: dict[str, str], new: dict[str, str]) -> Iterator[str]:
    old_shown, new_shown = redact_env(old), redact_env(new)
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) == new.get(key):
            continue
        if key not in new:
            yield f"env {key}: - (was {old_shown[key]})"
        elif key not in old:
            yield f"env {key}: + {new_shown[key]}"
        elif new_shown[key] == REDACTED:
            yield f"env {key}: {REDACTED} -> {REDACTED} (a secret's value changed)"
        else:
            yield f"env {key}: {old_shown[key]} -> {new_shown[key]}"


def field_changes(
    old: ProcessSpec, new: ProcessSpec, old_files: Mapping[str, str], new_files: Mapping[str, str]
) -> list[str]:
    """What differs between two runs of a process, as `up` would restart it."""
    lines = [*_argv_changes(old.argv, new.argv), *_env_changes(old.env, new.env)]
    if old.workdir != new.workdir:
        lines.append(f"workdir: {old.workdir} -> {new.workdir}")
    if old.host != new.host:
        lines.append(f"host: {old.host} -> {new.host}")
    for arg in new.argv:
        if arg in new_files and old_files.get(arg) != new_files[arg]:
            lines.append(f"engine args ({arg}): its content changed")
    return lines


def replica_changes(old: Plan | None, new: Plan) -> list[str]:
    before = Counter(p.component for p in old.processes) if old else Counter()
    after = Counter(p.component for p in new.processes)
    return [
        f"{c}: replicas {before[c]} -> {after[c]}"
        for c in sorted(before.keys() | after.keys())
        if before[c] != after[c] and before[c] and after[c]
    ]


def compare(built: Built) -> tuple[Plan | None, Plan, PlanChanges]:
    """The running plan (None when the graph does not run), the new one filled with its ports,
    and what `up` would change."""
    state = StateDir(built.plan.state_dir)
    running = state.read_plan() if state.supervisor() is not None else None
    new = fill_plan(built.plan, state.read_ports() if running else {})  # a copy: nothing is written
    old = {p.name: p for p in running.processes} if running else {}
    moved = moved_hosts(running, new)
    return running, new, plan_changes(old, running.files if running else {}, new, moved)


def print_diff(built: Built, console: Console) -> int:
    """Print what `up` would do; 0 when nothing, 1 when something."""
    running, new, changes = compare(built)
    if running is None:
        console.print(
            f"graph {new.graph} is not running: `up` would start all {len(new.processes)} processes"
        )
    old = {p.name: p for p in running.processes} if running else {}
    old_files = running.files if running else {}
    specs = {p.name: p for p in new.processes}
    moved = moved_hosts(running, new)
    for line in changes.lines():
        console.print(Text(line, style=_STYLE[line[0]]), highlight=False)
        name = line[2:].split(" ")[0]
        if name not in changes.changed:
            continue
        for field in field_changes(old[name], specs[name], old_files, new.files):
            console.print(f"    {field}", highlight=False, markup=False)
        if specs[name].host in moved:
            console.print(
                f"    host {specs[name].host}: reached differently (ssh or python)", highlight=False
            )
    for line in replica_changes(running, new):
        console.print(line, highlight=False)
    if not changes.lines():
        console.print(f"graph {new.graph}: no changes")
        return 0
    counts = (len(changes.added), len(changes.restarted), len(changes.removed))
    console.print("{} to start, {} to restart, {} to stop".format(*counts), highlight=False)
    return 1
