"""What the two Kubernetes renderers share: object names, secret-safe environment, where models
live in the cluster, and the deterministic multi-document YAML they print.

`manifests.py` (plain manifests running `dyngraph run`) and `dynamo_k8s.py` (a DynamoGraphDeployment
running Dynamo's own processes) dress the same graph for a cluster; keeping these rules in one
place makes a model, a secret or a name come out the same in both.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from dynamo_graph.graph.compile import local_path
from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.schema import Graph
from dynamo_graph.redact import is_secret_name, redact_url

MODELS_VOLUME = "models"
PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "dyngraph"}


def k8s_name(text: str) -> str:
    """An RFC 1123 label from a graph name or key: `My_Graph` -> `my-graph`."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].rstrip("-")
    return name or "x"


def component_names(graph: Graph) -> dict[str, str]:
    """Each component's object name (`k8s_name` of its key)."""
    return _unique_names(graph, k8s_name)


def dgd_service_names(graph: Graph) -> dict[str, str]:
    """Each component's DGD service name: its key, with `_` (which no Kubernetes name takes) as
    `-`; the case stays, as in Dynamo's own deployments (`VllmDecodeWorker`)."""
    return _unique_names(graph, lambda key: key.replace("_", "-"))


def _unique_names(graph: Graph, name_of: Callable[[str], str]) -> dict[str, str]:
    """Two keys that would share a name in the cluster are an error naming both."""
    names: dict[str, str] = {}
    for key in sorted(graph.components):
        name = name_of(key)
        clash = next((k for k, n in names.items() if n.lower() == name.lower()), None)
        if clash is not None:
            message = f"is {name!r} in Kubernetes, like components.{clash}; rename one"
            raise GraphError([Problem(f"components.{key}", message)])
        names[key] = name
    return names


def secret_name(graph: Graph) -> str:
    return graph.kubernetes.secret or f"{k8s_name(graph.name)}-secrets"


def is_secret(name: str, value: str) -> bool:
    """Variables whose value must come from a Secret: secret-looking names, URLs with credentials."""
    return is_secret_name(name) or redact_url(value) != value


def env_vars(graph: Graph, env: dict[str, str], secret_names: list[str] = ()) -> list[dict[str, Any]]:
    """Kubernetes EnvVars, sorted by name. Secret values never appear: such a variable (and each
    of `secret_names`, e.g. a frontend's API key variables) is a `secretKeyRef` into the graph's
    Secret under its own name, so `kubectl create secret generic <secret> --from-literal=NAME=...`
    is all the user adds."""
    out: dict[str, dict[str, Any]] = {}
    for name in secret_names:
        out[name] = _secret_ref(graph, name)
    for name, value in env.items():
        out[name] = _secret_ref(graph, name) if is_secret(name, value) else {"name": name, "value": value}
    return [out[name] for name in sorted(out)]


def _secret_ref(graph: Graph, name: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name(graph), "key": name}}}


def model_path(graph: Graph, plan: Plan, key: str) -> str:
    """Where a model is inside the cluster: a local folder or file under the models volume by its
    own name, a hub id unchanged."""
    path = graph.models[key].path
    local = local_path(path, Path(plan.graph_file).parent)
    if local is None:
        return path.removeprefix("hf://")
    return f"{graph.kubernetes.models.mount_path.rstrip('/')}/{local.name}"


def uses_models_volume(graph: Graph, plan: Plan) -> bool:
    """Whether workers mount the models volume: some model or LoRA adapter is a local path, or
    the graph names the storage. Hub ids alone need none (the image downloads them), so no
    claim is asked for."""
    storage = graph.kubernetes.models
    if storage.model_fields_set & {"claim", "host_path", "storage_class"}:
        return True
    graph_dir = Path(plan.graph_file).parent
    paths = [p for m in graph.models.values() for p in (m.path, *m.lora_adapters.values())]
    return any(local_path(p, graph_dir) is not None for p in paths)


def models_volume(graph: Graph) -> dict[str, Any]:
    storage = graph.kubernetes.models
    if storage.host_path is not None:
        return {"name": MODELS_VOLUME, "hostPath": {"path": storage.host_path, "type": "Directory"}}
    return {"name": MODELS_VOLUME, "persistentVolumeClaim": {"claimName": models_claim(graph)}}


def models_claim(graph: Graph) -> str:
    return graph.kubernetes.models.claim or f"{k8s_name(graph.name)}-models"


def models_mount(graph: Graph) -> dict[str, Any]:
    return {"name": MODELS_VOLUME, "mountPath": graph.kubernetes.models.mount_path}


def hf_home(graph: Graph) -> dict[str, str]:
    """Hub downloads land on the models volume, so a restarted pod does not fetch them again."""
    return {"HF_HOME": f"{graph.kubernetes.models.mount_path.rstrip('/')}/huggingface"}


def pod_defaults(graph: Graph) -> dict[str, Any]:
    """The pod-spec fields every pod of the graph shares."""
    k = graph.kubernetes
    spec: dict[str, Any] = {}
    if k.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in k.image_pull_secrets]
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    return spec


def metadata(graph: Graph, name: str, component: str | None = None) -> dict[str, Any]:
    labels = {PART_OF: k8s_name(graph.name), **MANAGED_BY}
    if component is not None:
        labels[COMPONENT] = component
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if graph.kubernetes.namespace:
        meta["namespace"] = graph.kubernetes.namespace
    return meta


class _PlainDumper(yaml.SafeDumper):
    """Writes a dict used twice (a selector and the pod labels) twice, not as `&id001`/`*id001`,
    which some tools and many readers trip over."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_documents(docs: list[dict[str, Any]], header: list[str]) -> str:
    """Multi-document YAML with sorted keys (lists keep their order, which is meaningful), after
    `#` header lines: the same graph gives the same bytes."""
    lines = [f"# {line}" if line else "#" for line in header]
    body = yaml.dump_all(
        docs, Dumper=_PlainDumper, sort_keys=True, default_flow_style=False, width=120, explicit_start=True
    )
    return "\n".join(lines) + ("\n" if lines else "") + body
