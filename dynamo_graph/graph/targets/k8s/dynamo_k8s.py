"""`render -f dynamo-k8s`: the graph as NVIDIA Dynamo's DynamoGraphDeployment (nvidia.com/v1alpha1).

Users of Dynamo's operator keep their cluster as it is and get the graph's services in its
custom resource: each worker runs `python3 -m dynamo.<backend>` with our engine settings mapped
onto that backend's flags (`BACKENDS`, which `dgd_import.py` reads the other way round), each
frontend `python3 -m dynamo.frontend` with its router settings as Dynamo 1.6's frontend spells
them (`router_flags`, also read back by the import). The operator brings discovery and planes,
so the graph's `runtime`, `infra` and `hosts` have no part in it.

What Dynamo cannot express (our frontend's limits and API keys, a worker's `max_inflight`, the
predictive router cost, strict priority order in the router queue, its bound, ...) is listed in
the header comment, never dropped silently (so is what `autoscale` cannot say as Dynamo's Planner,
dynamo_planner.py): such a router is rendered as the nearest Dynamo has
(its block cost; its `fcfs` queue, which honours priorities as a head start; an unbounded queue)
and the DGD still deploys. Engines Dynamo has no backend for (echo, llama.cpp, mistral.rs,
Python files) are an error naming the component and the engines it takes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_graph.graph.compile import local_path
from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.schema import Frontend, Graph, Limits, Router, Worker
from dynamo_graph.graph.targets.k8s.common import (
    dgd_service_names,
    dump_documents,
    env_vars,
    hf_home,
    k8s_name,
    model_path,
    models_claim,
    models_mount,
    models_volume,
    pod_defaults,
    uses_models_volume,
)
from dynamo_graph.graph.targets.k8s.dynamo_planner import planner_args, planner_service
from dynamo_graph.options import format_value, options
from dynamo_graph.router.config import RouterConfig

API_VERSION = "nvidia.com/v1alpha1"
KIND = "DynamoGraphDeployment"
# The runtime images and the frontend flags written. (The CRD schema the tests validate against
# is 0.6.0's, tests/fixtures/dynamo/; the DGD's v1alpha1 fields used here are unchanged since.)
DYNAMO_VERSION = "1.6.1"


@dataclass(frozen=True)
class Backend:
    """How one `python3 -m dynamo.<backend>` spells our engine settings. `role_args` are the
    disaggregation flags per role (an engine arg of the same flag replaces its default there);
    `implied` flags Dynamo's own deployments always pass and that our workers behave as if given;
    `aliases` are other spellings `import` accepts. With `override_flag`, engine args are the
    engine's own settings, written as that one JSON flag, except the worker's `worker_flags`."""

    module: str
    framework: str | None  # the DGD's backendFramework, or None (the mocker)
    model_path: str
    model_name: str
    context_length: str
    block_size: str
    tensor_parallel: str | None
    role_args: dict[str, list[str]]
    implied: list[str] = field(default_factory=list)
    engine_arg_flags: dict[str, str] = field(default_factory=dict)
    migration_limit: bool = True
    aliases: dict[str, str] = field(default_factory=dict)
    override_flag: str | None = None
    worker_flags: frozenset[str] = frozenset()


_PD = {"prefill": ["--disaggregation-mode", "prefill"], "decode": ["--disaggregation-mode", "decode"]}

BACKENDS: dict[str, Backend] = {
    "vllm": Backend(
        module="dynamo.vllm",
        framework="vllm",
        model_path="--model",
        model_name="--served-model-name",
        context_length="--max-model-len",
        block_size="--block-size",
        tensor_parallel="--tensor-parallel-size",
        # Dynamo 0.6's vLLM decode worker takes no flag; newer ones also read the generic forms.
        role_args={"prefill": ["--is-prefill-worker"], "decode": []},
        aliases={"--model-path": "--model", "-tp": "--tensor-parallel-size"},
    ),
    "sglang": Backend(
        module="dynamo.sglang",
        framework="sglang",
        model_path="--model-path",
        model_name="--served-model-name",
        context_length="--context-length",
        block_size="--page-size",
        tensor_parallel="--tp",
        role_args={
            "prefill": [*_PD["prefill"], "--disaggregation-transfer-backend", "nixl"],
            "decode": [*_PD["decode"], "--disaggregation-transfer-backend", "nixl"],
        },
        # Dynamo's frontend tokenizes, as ours does: SGLang gets token ids.
        implied=["--skip-tokenizer-init"],
        aliases={"--tp-size": "--tp", "--tensor-parallel-size": "--tp", "--model": "--model-path"},
    ),
    "trtllm": Backend(
        module="dynamo.trtllm",
        framework="trtllm",
        model_path="--model-path",
        model_name="--served-model-name",
        context_length="--max-seq-len",
        block_size="--kv-block-size",
        tensor_parallel="--tensor-parallel-size",
        role_args=_PD,
        aliases={"--model": "--model-path", "-tp": "--tensor-parallel-size"},
        # TensorRT-LLM's LLM API arguments (what our adapter takes as engine_args) ride in one
        # JSON over the engine config; these are Dynamo's worker's own flags.
        override_flag="--override-engine-args",
        worker_flags=frozenset(
            {
                "extra_engine_args",
                "publish_events_and_metrics",
                "modality",
                "endpoint",
                "disaggregation_strategy",
            }
        ),
    ),
    "mocker": Backend(
        module="dynamo.mocker",
        framework=None,
        model_path="--model-path",
        model_name="--model-name",
        context_length="--max-model-len",
        block_size="--block-size",
        tensor_parallel=None,
        role_args=_PD,
        engine_arg_flags={"num_gpu_blocks": "--num-gpu-blocks-override"},
        migration_limit=False,
    ),
}
ROLE_FLAGS = {"--is-prefill-worker": "prefill", "--is-decode-worker": "decode"}
"""Role flags of any backend, as Dynamo's releases spelled them."""


def engine_arg_flags(backend: Backend, args: dict[str, Any]) -> list[str]:
    """Engine args as the backend's command line: `key_name: v` -> `--key-name v`, true -> the bare
    flag, false -> `--no-key-name`, lists and maps as JSON; for a backend with an `override_flag`
    (TensorRT-LLM) the engine's own settings as that flag's one JSON object."""
    out: list[str] = []
    if backend.override_flag:
        own = {k: v for k, v in args.items() if k not in backend.worker_flags and v is not None}
        args = {k: v for k, v in args.items() if k in backend.worker_flags}
        if own:
            out += [backend.override_flag, json.dumps(own, sort_keys=True)]
    for key in sorted(args):
        value = args[key]
        flag = backend.engine_arg_flags.get(key, "--" + key.replace("_", "-"))
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag.removeprefix("--"))
        elif isinstance(value, dict | list):
            out += [flag, json.dumps(value, sort_keys=True)]
        else:
            out += [flag, str(value)]
    return out


def _engine_args(worker: Worker, graph_dir: Path) -> dict[str, Any]:
    """Inline args, or the JSON file's, read now: the DGD carries them on the command line."""
    if worker.engine_args_file is None:
        return dict(worker.engine_args or {})
    path = local_path(worker.engine_args_file, graph_dir)
    assert path is not None, "an engine args file is a local path"
    return json.loads(path.read_text())


def worker_args(graph: Graph, plan: Plan, worker: Worker) -> list[str]:
    backend = BACKENDS[worker.engine]
    model = graph.models[worker.model]
    args = [backend.model_path, model_path(graph, plan, worker.model), backend.model_name, str(model.name)]
    if model.context_length:
        args += [backend.context_length, str(model.context_length)]
    if model.kv_cache_block_size:
        args += [backend.block_size, str(model.kv_cache_block_size)]
    tp_given = "tensor_parallel_size" in worker.gpus.model_fields_set  # even 1: as the user wrote it
    if backend.tensor_parallel and (tp_given or worker.gpus.tensor_parallel_size > 1):
        args += [backend.tensor_parallel, str(worker.gpus.tensor_parallel_size)]
    if backend.migration_limit and worker.migration_limit:
        args += ["--migration-limit", str(worker.migration_limit)]
    args += backend.implied
    engine = engine_arg_flags(backend, _engine_args(worker, Path(plan.graph_file).parent))
    args += _role_args(backend.role_args.get(worker.role, []), set(engine))
    return args + engine


def _role_args(role_args: list[str], given: set[str]) -> list[str]:
    """A role's flags (each with the values after it) less those the engine args give."""
    out: list[str] = []
    for i, word in enumerate(role_args):
        if word.startswith("--"):
            j = next(
                (k for k in range(i + 1, len(role_args)) if role_args[k].startswith("--")), len(role_args)
            )
            if word not in given:
                out += role_args[i:j]
    return out


# Our router queue orders -> Dynamo's --router-queue-policy (fcfs | wspt). Dynamo's fcfs orders
# by arrival time less the request's priority (a head start), so it is the nearest to our strict
# priority order; our priority-blind fcfs has no Dynamo equivalent.
QUEUE_POLICIES = {"priority": "fcfs", "fcfs": "fcfs", "wspt": "wspt"}


def router_flags(router: Router) -> list[str]:
    """The kv router's settings as `python3 -m dynamo.frontend` 1.6 flags: each setting that
    Dynamo spells (its field's `dynamo`, router/config.py), where it differs from the default
    (our defaults are Dynamo's, the queue policy's mapped default included). Our overlap
    weight scales the prefill blocks against the decode blocks: Dynamo 1.6's prefill load scale."""
    config = RouterConfig(**router.model_dump())
    args = [] if config.use_kv_events else ["--no-router-kv-events"]
    for opt in options(RouterConfig):
        value = getattr(config, opt.name)
        if opt.spec.dynamo is None or value == opt.default or value is None:
            continue
        if opt.name == "queue_policy":
            value = QUEUE_POLICIES[value]
        args += [opt.spec.dynamo, format_value(value)]
    return args


def router_notes(key: str, router: Router) -> list[str]:
    """The kv router's settings Dynamo 1.6's frontend has no flag for, and what runs instead."""
    where = f"components.{key}.router"
    notes = []
    if router.cost == "predictive":
        notes.append(f"{where}.cost: predictive (Dynamo's frontend routes by its own block cost)")
    if router.queue_threshold is not None:
        if router.queue_policy != "wspt":
            notes.append(
                f"{where}.queue_policy: {router.queue_policy} (rendered as Dynamo's fcfs, which "
                "orders by arrival time less the priority, not by priority first)"
            )
        notes.append(f"{where}.max_queue_size: {router.max_queue_size} (Dynamo's queue is unbounded)")
        if router.queue_reserve:
            notes.append(f"{where}.queue_reserve: {router.queue_reserve} (Dynamo keeps no worker free)")
    return notes


def frontend_args(frontend: Frontend) -> list[str]:
    router = frontend.router
    args = ["--http-port", str(frontend.http.port), "--router-mode", router.mode]
    if router.mode == "kv":
        args += router_flags(router)
    if frontend.migration_limit is not None:
        args += ["--migration-limit", str(frontend.migration_limit)]
    if frontend.disagg.enforce:
        args.append("--enforce-disagg")
    return args


def not_rendered(graph: Graph) -> list[str]:
    """Settings that differ from their defaults and have no DGD equivalent."""
    notes = []
    for key, comp in sorted(graph.components.items()):
        if isinstance(comp, Frontend):
            for name, value in comp.limits.model_dump().items():
                if value != Limits.model_fields[name].default:
                    notes.append(f"components.{key}.limits.{name}: {value} (no flag of Dynamo's frontend)")
            if comp.api_key_env:
                notes.append(f"components.{key}.api_key_env: Dynamo's frontend does not check API keys")
            if comp.auth.keys_file is not None:
                notes.append(f"components.{key}.auth.keys_file: Dynamo's frontend has no tenants or API keys")
            if comp.disagg.conditional:
                notes.append(
                    f"components.{key}.disagg.conditional: Dynamo's --router-conditional-disagg "
                    "decides by its own policy, not by max_local_prefill_length"
                )
            if comp.router.mode == "kv":
                notes += router_notes(key, comp.router)
            if comp.models is not None:
                notes.append(f"components.{key}.models: Dynamo's frontend serves every model it discovers")
        else:
            if comp.max_inflight is not None:
                notes.append(f"components.{key}.max_inflight: {comp.max_inflight} (no Dynamo flag)")
            if comp.migration_limit and not BACKENDS[comp.engine].migration_limit:
                notes.append(f"components.{key}.migration_limit: {comp.engine} takes no --migration-limit")
            if comp.gpus.tensor_parallel_size > 1 and BACKENDS[comp.engine].tensor_parallel is None:
                notes.append(f"components.{key}.gpus.tensor_parallel_size: {comp.engine} has no such flag")
            if comp.static:
                notes.append(f"components.{key}.static: Dynamo's operator always uses discovery")
    notes += planner_args(graph)[1]
    if graph.security.tls == "required":
        notes.append("security.tls: required (the graph's CA is dyngraph's: set up Dynamo's own TLS)")
    for key, model in sorted(graph.models.items()):
        if model.lora_adapters:
            names = ", ".join(model.lora_adapters)
            notes.append(
                f"models.{key}.lora_adapters: {names} (declare each as a DynamoModel of modelType lora)"
            )
    return notes


def _check_engines(graph: Graph) -> None:
    problems = [
        Problem(
            f"components.{key}.engine",
            f"Dynamo has no backend for engine {w.engine!r}; render -f dynamo-k8s takes "
            f"{', '.join(sorted(BACKENDS))} (override it, e.g. components.{key}.engine=mocker)",
        )
        for key, w in sorted(graph.workers().items())
        if w.engine not in BACKENDS
    ]
    if problems:
        raise GraphError(problems)


def _image(graph: Graph) -> str:
    if graph.kubernetes.dynamo_image:
        return graph.kubernetes.dynamo_image
    frameworks = sorted({BACKENDS[w.engine].framework or "vllm" for w in graph.workers().values()})
    framework = frameworks[0] if len(frameworks) == 1 else "vllm"
    return f"nvcr.io/nvidia/ai-dynamo/{framework}-runtime:{DYNAMO_VERSION}"


def _service(
    graph: Graph, comp: Frontend | Worker, command: list[str], args: list[str], with_volume: bool
) -> dict[str, Any]:
    container: dict[str, Any] = {"image": _image(graph), "command": command, "args": args}
    pod = pod_defaults(graph)
    service: dict[str, Any] = {
        "dynamoNamespace": graph.namespace,
        "componentType": "frontend" if isinstance(comp, Frontend) else "worker",
        "replicas": comp.replicas,
    }
    env = dict(comp.env)
    secrets = comp.api_key_env if isinstance(comp, Frontend) else []
    if isinstance(comp, Worker):
        if comp.role != "agg":
            service["subComponentType"] = comp.role
        if comp.nodes > 1:  # the operator runs the replica over this many nodes (a LeaderWorkerSet)
            service["multinode"] = {"nodeCount": comp.nodes}
        if comp.gpus.per_replica:
            gpus = str(comp.gpus_per_node)  # Dynamo's resources are per node
            service["resources"] = {"requests": {"gpu": gpus}, "limits": {"gpu": gpus}}
        if graph.kubernetes.env_from_secret:
            service["envFromSecret"] = graph.kubernetes.env_from_secret
        if graph.kubernetes.working_dir:
            container["workingDir"] = graph.kubernetes.working_dir
        if with_volume:
            env.update(hf_home(graph))
            pod["volumes"] = [models_volume(graph)]
            container["volumeMounts"] = [models_mount(graph)]
    envs = env_vars(graph, env, secrets)
    if envs:
        service["envs"] = envs
    service["extraPodSpec"] = {**pod, "mainContainer": container}
    return service


def build_dgd(graph: Graph, plan: Plan) -> dict[str, Any]:
    """The DynamoGraphDeployment of a validated graph, as a plain dict."""
    _check_engines(graph)
    names = dgd_service_names(graph)
    with_volume = uses_models_volume(graph, plan)
    services: dict[str, Any] = {}
    for key, comp in sorted(graph.components.items()):
        if isinstance(comp, Frontend):
            services[names[key]] = _service(
                graph, comp, ["python3", "-m", "dynamo.frontend"], frontend_args(comp), False
            )
        else:
            backend = BACKENDS[comp.engine]
            command = ["python3", "-m", backend.module]
            args = worker_args(graph, plan, comp)
            services[names[key]] = _service(graph, comp, command, args, with_volume)
    planner, _ = planner_args(graph)
    if planner:
        services["Planner" if "Planner" not in services else "DyngraphPlanner"] = planner_service(
            graph, _image(graph), planner
        )
    spec: dict[str, Any] = {"services": services}
    storage = graph.kubernetes.models
    if with_volume and storage.claim is None and storage.host_path is None and storage.storage_class:
        spec["pvcs"] = [
            {
                "create": True,
                "name": models_claim(graph),
                "size": storage.size,
                "storageClass": storage.storage_class,
                "volumeAccessMode": "ReadWriteMany",
            }
        ]
    frameworks = {BACKENDS[w.engine].framework for w in graph.workers().values()}
    if len(frameworks) == 1 and None not in frameworks:
        spec["backendFramework"] = frameworks.pop()
    meta: dict[str, Any] = {"name": k8s_name(graph.name)}
    if graph.kubernetes.namespace:
        meta["namespace"] = graph.kubernetes.namespace
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}


def render_dynamo_k8s(graph: Graph, plan: Plan) -> str:
    header = [f"DynamoGraphDeployment of graph {graph.name!r} by dyngraph (Dynamo {DYNAMO_VERSION})."]
    dgd = build_dgd(graph, plan)  # first: it refuses engines Dynamo lacks, which the notes assume
    notes = not_rendered(graph)
    if notes:
        header += ["Not rendered (no DynamoGraphDeployment equivalent):", *[f"  {n}" for n in notes]]
    return dump_documents([dgd], header)
