"""A rollout's `checks: true`: the graph's own checks against a component's new replicas.

A frontend of their own, on a free port of this host with the graph's discovery settings,
routes only to the instances labelled with the revision being rolled out
(`--router-instance-labels revision=N`); `dyngraph test GRAPH --against URL --model M` runs the
graph's checks that ask the component's model through it (the graph as the plan recorded it,
so a rollback checks with the tests of the revision it brings back). Both are processes the
supervisor starts and stops like any other: graph/ runs the smoke room above it, never imports it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from dynamo_graph.frontend.settings import GROUP_ENV
from dynamo_graph.graph.plan import LOCAL, Plan, Probe, ProcessSpec, RestartPolicy
from dynamo_graph.graph.targets.local.logs import tail_lines
from dynamo_graph.graph.targets.local.ports import free_port, plan_ports
from dynamo_graph.graph.targets.local.process import LocalProcess
from dynamo_graph.graph.targets.local.state import StateDir, atomic_write

CHECKS_TIMEOUT_S = 300.0  # the whole run of the checks, the model's listing wait included
OUTPUT_LINES = 30
# Its own frontend, on 127.0.0.1: no API keys, and no member of the graph's frontend group.
_PRIVATE = {"DYN_API_KEY": "", "DYN_API_KEY_ENV": "", GROUP_ENV: ""}


def _model_name(spec: ProcessSpec) -> str | None:
    argv = spec.argv
    return argv[argv.index("--model-name") + 1] if "--model-name" in argv[:-1] else None


def _env(plan: Plan, worker: ProcessSpec) -> dict[str, str]:
    """A frontend's environment as the graph gives it (discovery, planes), else the worker's."""
    frontend = next((p for p in plan.processes if p.shares_ports), worker)
    return {**frontend.env, **_PRIVATE}


def _spec(name: str, component: str, argv: list[str], env: dict[str, str], workdir: str) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        component=component,
        replica=0,
        host=LOCAL,
        argv=argv,
        env=env,
        workdir=workdir,
        ports={},
        depends_on=[],
        readiness=Probe("tcp", "127.0.0.1:0", CHECKS_TIMEOUT_S),
        restart=RestartPolicy("never", 0, 0.0, 0.0),
        shutdown_grace_s=5.0,
    )


async def check_revision(state: StateDir, plan: Plan, worker: ProcessSpec, revision: int) -> str | None:
    """Run the checks against `worker`'s component at `revision`; None when they passed, else
    what failed (the runner's last output lines)."""
    component = worker.component
    graph_file = state.root / "checks" / f"graph-{revision}.json"
    atomic_write(graph_file, plan.graph_json)
    port = free_port(plan_ports(plan))
    url = f"http://127.0.0.1:{port}"
    env = _env(plan, worker)
    workdir = str(state.root)
    serve = ["dyngraph", "run", "in=http", "out=auto", "--http-host", "127.0.0.1", "--http-port", str(port)]
    frontend = LocalProcess(
        _spec(
            f"checks-{component}-frontend",
            component,
            [*serve, "--router-instance-labels", f"revision={revision}"],
            env,
            workdir,
        ),
        state.log_file(f"checks-{component}-frontend"),
        plan.local_python,
    )
    model = _model_name(worker)
    log = state.log_file(f"checks-{component}")
    runner = LocalProcess(
        _spec(
            f"checks-{component}",
            component,
            ["dyngraph", "test", str(graph_file), "--against", url, *(["--model", model] if model else [])],
            env,
            workdir,
        ),
        log,
        plan.local_python,
    )
    await frontend.start(1)
    try:
        await runner.start(1)
        try:
            code = await asyncio.wait_for(runner.wait(), CHECKS_TIMEOUT_S)
        except TimeoutError:
            await runner.stop()
            return f"the checks did not end within {CHECKS_TIMEOUT_S:g} s\n{_output(log)}"
    finally:
        await frontend.stop()
    return None if code == 0 else _output(log)


def _output(log: Path) -> str:
    return "\n".join(tail_lines(log, OUTPUT_LINES))
