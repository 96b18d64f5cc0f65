"""Launch-plan processes for the unit tests of what the supervisor does with plans (changes,
rollouts, revisions): a `ProcessSpec` from its name, with only what a test varies given."""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo_graph.graph.plan import Probe, ProcessSpec, RestartPolicy


def process_spec(
    name: str, *, deps: tuple[str, ...] = (), argv: tuple[str, ...] = (), host: str = "local", **fields: Any
) -> ProcessSpec:
    """`name` is `<component>-<replica>` (or `...-<replica>.rank<r>`, a rank of a replica over
    nodes); `fields` replace any other field (rollout, rolls, group, rank...)."""
    component, replica = name.partition(".rank")[0].rsplit("-", 1)
    spec = ProcessSpec(
        name=name,
        component=component,
        replica=int(replica),
        host=host,
        argv=["dyngraph", "run", *argv],
        env={"A": "1"},
        workdir="/w",
        ports={},
        depends_on=list(deps),
        readiness=Probe("log", "serving model", 5.0),
        restart=RestartPolicy("on-failure", 5, 1.0, 30.0),
        shutdown_grace_s=10.0,
    )
    return msgspec.structs.replace(spec, **fields) if fields else spec
