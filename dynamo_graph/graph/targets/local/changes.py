"""What making a plan the running one changes: which processes start, restart and stop.

One computation for the supervisor's `apply` (which then does it) and for `dyngraph diff` /
`up --dry-run` (which only tell), so that what they tell is what `up` does. Plans compared
here have their ports filled (ports.py), as the supervisor runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dynamo_graph.graph.plan import Plan, ProcessSpec


def launch_identity(spec: ProcessSpec, files: Mapping[str, str]) -> tuple[object, ...]:
    """What makes two specs the same running process: a change here means a restart. The files
    the supervisor writes for a process (inline engine args) count by their content, since their
    path on the command line stays the same when the graph changes what is in them."""
    contents = tuple(files[arg] for arg in spec.argv if arg in files)
    return (spec.argv, spec.env, spec.workdir, spec.host, contents)


@dataclass(frozen=True)
class PlanChanges:
    """Process names, each list in the new (or, for `removed`, the old) plan's order."""

    added: list[str]
    changed: list[str]  # their own launch identity differs, or their host's connection does
    dependents: dict[str, list[str]]  # unchanged, restarted since these dependencies restart
    removed: list[str]

    @property
    def restarted(self) -> list[str]:
        return [*self.changed, *self.dependents]

    def lines(self) -> list[str]:
        """`+ name`, `~ name`, `- name`: what the supervisor reports and `up` prints."""
        dependents = [f"~ {n} (restarts with {', '.join(deps)})" for n, deps in self.dependents.items()]
        return (
            [f"+ {n}" for n in self.added]
            + [f"~ {n}" for n in self.changed]
            + dependents
            + [f"- {n}" for n in self.removed]
        )


def moved_hosts(old: Plan | None, new: Plan) -> set[str]:
    """Remote hosts reached differently now (address, user, python...): their processes restart."""
    return {h for h in new.hosts if old is not None and old.hosts.get(h) != new.hosts[h]}


def plan_changes(
    old: Mapping[str, ProcessSpec], old_files: Mapping[str, str], new: Plan, moved: set[str]
) -> PlanChanges:
    """Compare the running processes `old` (by name; `old_files` as the running plan wrote them)
    with the filled plan `new`. A process restarts when it changed, and so does every process
    that depends on one that restarts: it connected to the old one (etcd, a static worker)."""
    specs = {p.name: p for p in new.processes}
    added = [n for n in specs if n not in old]
    changed = [
        n
        for n, spec in specs.items()
        if n in old
        and (launch_identity(old[n], old_files) != launch_identity(spec, new.files) or spec.host in moved)
    ]
    restarting = set(changed)
    dependents: dict[str, list[str]] = {}
    grew = True
    while grew:  # a dependent's dependents restart too
        grew = False
        for name, spec in specs.items():
            deps = [d for d in spec.depends_on if d in restarting]
            if deps and name in old and name not in restarting:
                dependents[name] = deps
                restarting.add(name)
                grew = True
    ordered = {n: dependents[n] for n in specs if n in dependents}
    removed = [n for n in old if n not in specs]
    return PlanChanges(added, changed, ordered, removed)
