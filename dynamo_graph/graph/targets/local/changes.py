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
    in_place: frozenset[str] = frozenset()  # changed ones whose old run stops before the new starts

    @property
    def restarted(self) -> list[str]:
        return [*self.changed, *self.dependents]

    @property
    def stops_first(self) -> list[str]:
        """Restarted processes whose old run stops before the new one starts."""
        return [n for n in self.restarted if n in self.in_place or n in self.dependents]

    @property
    def rolled(self) -> list[str]:
        """Changed processes replaced by a new run started beside the old one (rollout.py)."""
        return [n for n in self.changed if n not in self.in_place]

    def lines(self) -> list[str]:
        """`+ name`, `~ name`, `- name`: what the supervisor reports and `up` prints; a process
        whose old run must stop before its new one starts says so (a gap in its service)."""
        dependents = [f"~ {n} (restarts with {', '.join(deps)})" for n, deps in self.dependents.items()]
        changed = [f"~ {n}" + (" (stops first)" if n in self.in_place else "") for n in self.changed]
        return [f"+ {n}" for n in self.added] + changed + dependents + [f"- {n}" for n in self.removed]


def moved_hosts(old: Plan | None, new: Plan) -> set[str]:
    """Remote hosts reached differently now (address, user, python...): their processes restart."""
    return {h for h in new.hosts if old is not None and old.hosts.get(h) != new.hosts[h]}


def plan_changes(
    old: Mapping[str, ProcessSpec], old_files: Mapping[str, str], new: Plan, moved: set[str]
) -> PlanChanges:
    """Compare the running processes `old` (by name; `old_files` as the running plan wrote them)
    with the filled plan `new`. A changed process that `rolls` gets its new run beside the old
    one, which leaves the processes depending on it alone (they find the new run in discovery);
    one that cannot (etcd, nats, a static worker, or on a moved host) stops first, and every
    process that depends on it restarts too: it connected to the old one."""
    specs = {p.name: p for p in new.processes}
    added = [n for n in specs if n not in old]
    changed = [
        n
        for n, spec in specs.items()
        if n in old
        and (launch_identity(old[n], old_files) != launch_identity(spec, new.files) or spec.host in moved)
    ]
    in_place = {n for n in changed if not (specs[n].rolls and old[n].rolls) or specs[n].host in moved}
    restarting = set(in_place)
    dependents: dict[str, list[str]] = {}
    grew = True
    while grew:  # a dependent's dependents restart too
        grew = False
        for name, spec in specs.items():
            deps = [d for d in spec.depends_on if d in restarting]
            if deps and name in old and name not in restarting:
                restarting.add(name)
                grew = True
                if name in changed:
                    in_place.add(name)  # changed too, but what it depends on goes away
                else:
                    dependents[name] = deps
    ordered = {n: dependents[n] for n in specs if n in dependents}
    removed = [n for n in old if n not in specs]
    return PlanChanges(added, changed, ordered, removed, frozenset(in_place))


def _pairings(plan: Plan) -> dict[str, dict[str, set[str]]]:
    """Per model, the pairing signatures of its prefill and of its decode workers."""
    out: dict[str, dict[str, set[str]]] = {}
    for spec in plan.processes:
        if spec.pairing:
            model = spec.pairing.rpartition("@")[0]
            out.setdefault(model, {}).setdefault(spec.role, set()).add(spec.pairing)
    return out


def unpaired(old: Plan | None, new: Plan) -> str | None:
    """Why `new` cannot roll out over `old`: it changes what a model's prefill and decode
    workers must share (model files, KV block size, engine, connector) while both pools serve,
    so a rolling update would hand an old prefill worker's KV to a new decode worker (or the
    reverse). None when it can."""
    if old is None:
        return None
    before, after = _pairings(old), _pairings(new)
    for model, pools in before.items():
        now = after.get(model, {})
        if not {"prefill", "decode"} <= pools.keys() or not {"prefill", "decode"} <= now.keys():
            continue  # one pool is (or will be) gone: nothing pairs across revisions
        if set().union(*pools.values()) != set().union(*now.values()):
            return (
                f"model {model}: this revision changes what its prefill and decode workers must "
                "share (model files, KV block size, engine or KV connector), and while both pools "
                "roll an old prefill worker would hand its KV to a new decode worker. Apply it in "
                "steps: set the prefill component's `replicas: 0` (the decode workers prefill "
                "themselves; with `disagg.enforce` requests get 503 meanwhile), change the "
                "workers, then bring the prefill replicas back"
            )
    return None
