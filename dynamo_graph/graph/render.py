"""`dyngraph render`'s formats of the graph itself: the graph and its plan as YAML, JSON or a
mermaid drawing, and the secret redaction every rendering (and `dyngraph diff`) shares. Each
launch target adds its own formats (graph/targets/: a shell script, Kubernetes manifests, a
Dynamo DGD, an sbatch script); graph/targets/dispatch.py lists them all.

All are deterministic text (a test renders twice and compares bytes), so they can be committed,
diffed in review and used as a dry run of `dyngraph up`.

Secrets never appear in them: values of environment variables and options whose names look
secret (KEY, TOKEN, SECRET, PASSWORD, CREDENTIAL, ...) and the user-info part of URLs
(`nats://user:password@host`) are replaced by `***`. API keys reach a frontend only through its
environment (`api_key_env` names the variables), so the plan holds no key of its own.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import yaml

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.schema import Graph
from dynamo_graph.redact import REDACTED, is_secret_name, redact_url


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: REDACTED if is_secret_name(k) and v else redact_url(v) for k, v in env.items()}


def redact_argv(argv: list[str]) -> list[str]:
    out: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next and not arg.startswith("--"):  # a flag next: the secret-named one takes no value
            out.append(REDACTED)
            secret_next = False
            continue
        secret_next = False
        flag, sep, _ = arg.partition("=")
        if arg.startswith("--") and is_secret_name(flag):
            if sep:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(arg)
                secret_next = True
            continue
        out.append(redact_url(arg))
    return out


def redact(value: Any) -> Any:
    """A JSON-like document with secrets replaced (see the module's docstring)."""
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(v, str) and v and is_secret_name(str(k)) else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return redact_argv(value)
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value


def redact_plan(plan: Plan) -> Plan:
    processes = [
        msgspec.structs.replace(p, argv=redact_argv(p.argv), env=redact_env(p.env)) for p in plan.processes
    ]
    files = {path: redact_url(text) for path, text in plan.files.items()}
    return msgspec.structs.replace(plan, processes=processes, files=files)


def _document(graph: Graph, plan: Plan) -> dict[str, Any]:
    return redact({"graph": graph.model_dump(mode="json"), "plan": msgspec.to_builtins(plan)})


def render_yaml(graph: Graph, plan: Plan) -> str:
    return yaml.safe_dump(_document(graph, plan), sort_keys=False, default_flow_style=False, width=120)


def render_json(graph: Graph, plan: Plan) -> str:
    return json.dumps(_document(graph, plan), indent=2) + "\n"


def _node(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def render_mermaid(graph: Graph, plan: Plan) -> str:
    """Components, endpoints and routing: client -> frontends -> endpoints -> worker replicas."""
    out = ["flowchart LR", "  client((client))"]
    replicas: dict[str, list[str]] = {}
    for proc in plan.processes:
        replicas.setdefault(proc.component, []).append(f"{proc.name}@{proc.host}")
    for name, comp in sorted(graph.frontends().items()):
        out.append(f'  {_node(name)}["{name}<br/>http {comp.http.host}:{comp.http.port}"]')
        out.append(f"  client --> {_node(name)}")
    for name, worker in sorted(graph.workers().items()):
        endpoint = str(worker.endpoint_name())
        ep_node = "ep_" + _node(endpoint)
        out.append(f'  {ep_node}{{{{"{endpoint}"}}}}')
        model = graph.models[worker.model]
        out.append(
            f'  subgraph {_node(name)}["{name}: {worker.engine}, model {model.name}, role {worker.role}"]'
        )
        out += [f'    {_node(r)}["{r}"]' for r in replicas.get(name, [])]
        out.append("  end")
        out += [f"  {ep_node} --> {_node(r)}" for r in replicas.get(name, [])]
        step = {"prefill": "1 prefill, ", "decode": "2 decode, "}.get(worker.role, "")
        for fname, front in sorted(graph.frontends().items()):
            if front.models is None or worker.model in front.models:
                out.append(f"  {_node(fname)} -->|{step}{front.router.mode}| {ep_node}")
    # Disaggregated models: prefill workers hand each prompt's KV cache to decode workers.
    for pname, prefill in sorted(graph.workers().items()):
        if prefill.role != "prefill":
            continue
        for dname, decode in sorted(graph.workers().items()):
            if decode.role == "decode" and decode.model == prefill.model:
                out.append(f"  {_node(pname)} -.->|KV cache| {_node(dname)}")
    for infra in ("etcd", "nats"):
        if infra in replicas:
            out.append(f"  {infra}[({infra})]")
    out.append(
        f"  %% runtime: discovery {graph.runtime.discovery}, request plane {graph.runtime.request_plane}, "
        f"events {graph.runtime.event_plane}"
    )
    return "\n".join(out) + "\n"
