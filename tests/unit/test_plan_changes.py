"""What `up` changes in a running plan (graph/targets/local/changes.py), which the supervisor does and
`dyngraph diff` prints: restarts follow `depends_on`, engine-args files count by content."""

from __future__ import annotations

import msgspec

from dynamo_graph.graph.plan import Plan, ProcessSpec, RemoteHost
from dynamo_graph.graph.targets.local.changes import moved_hosts, plan_changes
from dynamo_graph.graph.targets.local.diff import field_changes
from tests.support.plans import process_spec as _spec


def _plan(*specs: ProcessSpec, files: dict[str, str] | None = None, hosts: dict | None = None) -> Plan:
    return Plan("g", "g", "/g.yaml", "/state", files or {}, list(specs), hosts or {})


def test_restarts_follow_dependencies_transitively() -> None:
    old = _plan(
        _spec("etcd-0"),
        _spec("w-0", deps=("etcd-0",)),
        _spec("f-0", deps=("w-0",)),
        _spec("x-0"),
    )
    new_etcd = msgspec.structs.replace(old.processes[0], env={"A": "2"})
    new = _plan(new_etcd, *old.processes[1:3], _spec("y-0", deps=("etcd-0",)))
    changes = plan_changes({p.name: p for p in old.processes}, {}, new, set())
    assert changes.added == ["y-0"]  # new: started, not restarted
    assert changes.changed == ["etcd-0"]
    assert changes.dependents == {"w-0": ["etcd-0"], "f-0": ["w-0"]}
    assert changes.removed == ["x-0"]
    assert changes.lines() == [
        "+ y-0",
        "~ etcd-0 (stops first)",
        "~ w-0 (restarts with etcd-0)",
        "~ f-0 (restarts with w-0)",
        "- x-0",
    ]


def test_a_process_that_rolls_leaves_its_dependents_alone() -> None:
    """A worker's new run starts beside the old one: the frontend depending on it finds it in
    discovery and keeps running; a changed process depending on one that stops first restarts."""
    etcd = _spec("etcd-0")
    w = msgspec.structs.replace(_spec("w-0", deps=("etcd-0",)), rolls=True)
    f = msgspec.structs.replace(_spec("f-0", deps=("w-0",)), rolls=True)
    old = _plan(etcd, w, f)
    new = _plan(etcd, msgspec.structs.replace(w, env={"A": "2"}), f)
    changes = plan_changes({p.name: p for p in old.processes}, {}, new, set())
    assert changes.rolled == ["w-0"]
    assert changes.lines() == ["~ w-0"]
    both = _plan(msgspec.structs.replace(etcd, env={"A": "2"}), new.processes[1], f)
    changes = plan_changes({p.name: p for p in old.processes}, {}, both, set())
    assert changes.rolled == []
    assert changes.lines() == ["~ etcd-0 (stops first)", "~ w-0 (stops first)", "~ f-0 (restarts with w-0)"]


def test_a_new_dependency_restarts_nothing() -> None:
    old = _plan(_spec("w-0"), _spec("f-0", deps=("w-0",)))
    new = _plan(_spec("w-0"), _spec("w-1"), _spec("f-0", deps=("w-0", "w-1")))
    changes = plan_changes({p.name: p for p in old.processes}, {}, new, set())
    assert changes.lines() == ["+ w-1"]


def test_engine_args_count_by_content_and_moved_hosts_restart() -> None:
    args = ("--extra-engine-args", "/state/engine-args/w.json")
    old = _plan(
        _spec("w-0", argv=args),
        _spec("r-0", host="h1"),
        files={args[1]: "{}"},
        hosts={"h1": RemoteHost("a")},
    )
    same = plan_changes({p.name: p for p in old.processes}, old.files, old, set())
    assert same.lines() == []
    new = _plan(*old.processes, files={args[1]: '{"x": 1}'}, hosts={"h1": RemoteHost("b")})
    moved = moved_hosts(old, new)
    assert moved == {"h1"}
    assert plan_changes({p.name: p for p in old.processes}, old.files, new, moved).changed == ["w-0", "r-0"]


def test_field_changes_name_what_differs_and_hide_secrets() -> None:
    old = _spec("w-0", argv=("--max-inflight", "8", "--api-key", "old-secret", "--static-worker"))
    new = msgspec.structs.replace(
        _spec("w-0", argv=("--max-inflight", "16", "--api-key", "new-secret", "--migration-limit", "2")),
        env={"A": "2", "HF_TOKEN": "hf_secret", "NATS_SERVER": "nats://user:pw@h:4222"},
        workdir="/elsewhere",
    )
    lines = field_changes(old, new, {}, {})
    assert lines == [
        "argv: --max-inflight 8 -> --max-inflight 16",
        "argv: --api-key *** --static-worker -> --api-key *** --migration-limit 2",
        "env A: 1 -> 2",
        "env HF_TOKEN: + ***",
        "env NATS_SERVER: + nats://***@h:4222",
        "workdir: /w -> /elsewhere",
    ]
    assert not any("secret" in line for line in lines)
    assert field_changes(old, msgspec.structs.replace(old, argv=old.argv[:-1]), {}, {}) == [
        "argv: - --static-worker"
    ]
    grown = msgspec.structs.replace(old, argv=[*old.argv, "--migration-limit", "2"])
    assert field_changes(old, grown, {}, {}) == ["argv: + --migration-limit 2"]
