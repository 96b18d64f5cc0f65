"""`dyngraph import`: a Dynamo DynamoGraphDeployment (DGD) read back into a graph file.

Dynamo operator users have their deployments as DGDs; imported, one runs locally like any graph
(with `components.X.engine=mocker` it becomes a CI smoke graph on a laptop). Services become
components: frontends with the router settings of `python3 -m dynamo.frontend` (or
DYN_ROUTER_MODE), workers with the engine of `python3 -m dynamo.<backend>` and its flags read
through `dynamo_k8s.BACKENDS`, the table the renderer writes them with, so importing and
rendering back keeps services, replicas and component types.

Dynamo's implicit defaults are made explicit, so the graph says what the deployment runs and
validates for our engines too: the NIXL connector Dynamo's vLLM worker gives a prefill or decode
worker when the DGD names none, SGLang's default transfer backend, and the settings of the
TensorRT-LLM engine config file a worker's `--extra-engine-args` names (its
`cache_transceiver_config` above all), read from where the DGD's container path leads next to the
DGD file (a checkout of Dynamo's repository, say), or a note that it cannot be read.
`multinode.nodeCount` becomes the worker's `nodes`, its GPUs per node x nodes the replica's
`gpus.per_replica` (the graph places all ranks on `local` until its placement names hosts). A
Planner service becomes `autoscale` on the prefill and decode pools (dynamo_planner.py).

Nothing is dropped silently. A worker flag with no graph setting stays in `engine_args` (the
renderer writes it back as the same flag); anything else without an equivalent (a frontend flag
we lack, a CPU request, a probe, an env from a Secret) is listed in the notes, which the CLI
prints and the graph file keeps in its header comment. Where the graph validates for Dynamo's
operator but not for our engines, the reasons are notes too.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.targets.k8s.dynamo_k8s import API_VERSION, BACKENDS, KIND, ROLE_FLAGS, Backend
from dynamo_graph.graph.targets.k8s.dynamo_planner import MODULE as PLANNER_MODULE
from dynamo_graph.graph.targets.k8s.dynamo_planner import read_planner
from dynamo_graph.options import options
from dynamo_graph.router.config import RouterConfig

_ROUTER_MODES = ("random", "round-robin", "kv")


def _queue_policy(value: str) -> str:
    """Dynamo's queue policy as ours: its fcfs orders by arrival less the priority, nearest to
    our priority order (dynamo_k8s.QUEUE_POLICIES the other way)."""
    policies = {"fcfs": "priority", "wspt": "wspt"}
    if value not in policies:
        raise ValueError(f"not one of {', '.join(policies)}")
    return policies[value]


# Dynamo's frontend router flags -> the graph's router keys: the settings Dynamo spells
# (router/config.py, the same table dynamo_k8s.router_flags writes), and older spellings.
_OLD_DYNAMO_FLAGS = {
    "--router-kv-overlap-score-weight": "--router-prefill-load-scale",  # Dynamo 1.x, deprecated
    "--kv-overlap-score-weight": "--router-prefill-load-scale",  # Dynamo 0.x
}
_ROUTER_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    opt.spec.dynamo: (opt.name, _queue_policy if opt.name == "queue_policy" else opt.kind)
    for opt in options(RouterConfig)
    if opt.spec.dynamo is not None
}
_ROUTER_FLAGS.update({old: _ROUTER_FLAGS[new] for old, new in _OLD_DYNAMO_FLAGS.items()})
_SERVICE_KEYS = {"dynamoNamespace", "componentType", "subComponentType", "replicas", "envFromSecret", "envs"}
# The KV connector Dynamo's vLLM worker configures for a prefill or decode worker whose DGD names
# none (its `--connector` defaults to nixl: NixlConnector in role kv_both).
VLLM_DEFAULT_CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
SGLANG_DEFAULT_TRANSFER_BACKEND = "mooncake"  # ServerArgs.disaggregation_transfer_backend's default
PLANNER_MODULES = {PLANNER_MODULE, "dynamo.planner", "dynamo.planner.planner_sla"}
_CONTAINER_KEYS = {"image", "command", "args", "workingDir", "env"}


class DgdError(ValueError):
    """The file is not a DynamoGraphDeployment this importer reads."""


@dataclass
class Imported:
    name: str
    graph: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def text(self, source: str) -> str:
        """The graph file: a header naming the source and every note, then the graph."""
        header = [f"Imported from {source} by `dyngraph import`."]
        if self.notes:
            header += ["Not imported, or kept as engine_args:", *[f"  {n}" for n in self.notes]]
        body = yaml.safe_dump(self.graph, sort_keys=False, default_flow_style=False, width=120)
        return "".join(f"# {line}\n" for line in header) + body


def import_dgd_file(source: Path, output: Path) -> Imported:
    """Read a DGD, write its graph to `output` and validate it there: for Dynamo's operator (a
    GraphError when that fails), then for our engines, whose problems (an engine config file
    that could not be read, say) become notes. Files the DGD names are looked for next to it.
    Raises DgdError for an unreadable DGD."""
    try:
        doc = yaml.safe_load(source.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise DgdError(str(e)) from None
    imported = import_dgd(doc, source.resolve().parent)
    output.write_text(imported.text(source.name))
    build(output, engines="dynamo")
    try:
        build(output)
    except GraphError as e:
        imported.notes += [f"not runnable with our engines as imported: {p}" for p in e.problems]
        output.write_text(imported.text(source.name))
    return imported


def mocker_overrides(graph: dict[str, Any], model: str) -> list[str]:
    """The overrides that run an imported graph on a machine without GPUs or Dynamo's engines:
    every worker on the mocker (its engine args, for the real engine, dropped; no GPUs; one node) serving
    `model` (a local folder) instead."""
    overrides = [f"models.{key}.path={model}" for key in graph["models"]]
    for key, comp in graph["components"].items():
        if comp["kind"] != "worker":
            continue
        overrides.append(f"components.{key}.engine=mocker")
        overrides += [
            f"~components.{key}.{field}" for field in ("engine_args", "gpus", "nodes") if field in comp
        ]
    return overrides


def import_dgd(doc: Any, files: Path | None = None) -> Imported:
    """The graph of a DGD; `files`: where the container paths it names (engine config files) are
    looked for, in it or a folder above it (None: nowhere)."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise DgdError(f"expected kind: {KIND}")
    if doc.get("apiVersion") != API_VERSION:
        raise DgdError(f"expected apiVersion: {API_VERSION} (v1beta1 is not read yet)")
    services = (doc.get("spec") or {}).get("services")
    if not isinstance(services, dict) or not services:
        raise DgdError("spec.services is empty")
    return _Importer(doc, files).run()


def find_local_file(container_path: str, working_dir: str | None, near: Path | None) -> Path | None:
    """The local copy of a file a container names (relative to its working dir): the longest
    tail of its path, of two parts at least, found in `near` or a folder above it."""
    if near is None:
        return None
    full = Path(working_dir or "/") / container_path
    parts = [p for p in full.parts if p not in ("/", ".")]
    for start in range(len(parts) - 1):
        tail = Path(*parts[start:])
        for folder in (near, *near.parents):
            if (folder / tail).is_file():
                return folder / tail
    return None


def _name(text: str) -> str:
    """A graph name or key: letters, digits, '_' and '-'."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "imported"


def _scalar(text: str) -> Any:
    """A flag's value as YAML reads it (`16` -> 16, `{"a": 1}` -> a map), else the string."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, int | float | bool | dict | list) else text


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not re.match(r"^-[0-9.]", token)


def parse_flags(args: list[str]) -> list[tuple[str, str | None]]:
    """`--a 1 --b --c=2 x` -> [(--a, 1), (--b, None), (--c, 2), ("", x)] (positionals unnamed)."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        token = args[i]
        if not _is_flag(token):
            out.append(("", token))
        elif token.startswith("--") and "=" in token:
            flag, _, value = token.partition("=")
            out.append((flag, value))
        elif i + 1 < len(args) and not _is_flag(args[i + 1]):
            out.append((token, args[i + 1]))
            i += 1
        else:
            out.append((token, None))
        i += 1
    return out


def command_line(container: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(module, its args) of `python3 -m MODULE ARGS`, whether command and args are lists or one
    shell string (`args: ["python3 -m dynamo.frontend --http-port 8000"]`, `sh -c "..."`)."""
    words = [str(part) for part in [*(container.get("command") or []), *(container.get("args") or [])]]
    if len(words) >= 3 and words[0].endswith(("sh", "bash")) and words[1] == "-c":
        words = shlex.split(" ".join(words[2:]))
    elif words and " " in words[0] and not words[0].startswith(("{", "[")):
        words = shlex.split(words[0]) + words[1:]  # a command line in one string
    if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1] == "-m":
        return words[2], words[3:]
    return None, words


class _Importer:
    def __init__(self, doc: dict[str, Any], files: Path | None = None) -> None:
        self.doc = doc
        self.files = files
        self.notes: list[str] = []
        self.models: dict[str, dict[str, Any]] = {}
        self.components: dict[str, dict[str, Any]] = {}
        self.images: Counter[str] = Counter()
        self.namespaces: Counter[str] = Counter()
        self.env_secrets: Counter[str] = Counter()
        self.working_dirs: Counter[str] = Counter()
        self.planners: list[tuple[str, list[tuple[str, str | None]]]] = []
        spec = doc.get("spec") or {}
        self.graph_env = self._env("spec.envs", spec.get("envs") or [])
        for key in sorted(set(spec) - {"services", "envs", "backendFramework"}):
            self.notes.append(f"spec.{key}: not imported")

    def run(self) -> Imported:
        for name, service in sorted(self.doc["spec"]["services"].items()):
            self._service(name, service or {})
        meta = self.doc.get("metadata") or {}
        name = _name(str(meta.get("name", "imported")))
        graph: dict[str, Any] = {"name": name}
        if self.namespaces:
            graph["namespace"] = _name(self.namespaces.most_common(1)[0][0])
        planned = self._planner()
        graph.update(planned)
        gpus = sum(c["gpus"]["per_replica"] * c["replicas"] for c in self.components.values() if "gpus" in c)
        gpus = max(gpus, planned.get("max_gpus", 0))
        if gpus:
            # The graph says where it runs; Dynamo's services need this many GPUs in all.
            graph["hosts"] = {"local": {"gpus": gpus}}
        graph["models"] = self.models
        graph["components"] = self.components
        kubernetes: dict[str, Any] = {}
        if self.images:
            kubernetes["dynamo_image"] = self.images.most_common(1)[0][0]
        if meta.get("namespace"):
            kubernetes["namespace"] = meta["namespace"]
        if self.env_secrets:
            kubernetes["env_from_secret"] = self.env_secrets.most_common(1)[0][0]
        if self.working_dirs:
            kubernetes["working_dir"] = self.working_dirs.most_common(1)[0][0]
        if kubernetes:
            graph["kubernetes"] = kubernetes
        self._differing("image", self.images)
        self._differing("dynamoNamespace", self.namespaces)
        self._differing("envFromSecret", self.env_secrets)
        self._differing("workingDir", self.working_dirs)
        # Locally the supervisor starts a frontend after the workers that serve its requests, as
        # the shipped templates do (Kubernetes starts everything at once, so the DGD has no order).
        serving = sorted(k for k, c in self.components.items() if c.get("role") in ("agg", "decode"))
        for comp in self.components.values():
            if comp["kind"] == "frontend" and serving:
                comp["depends_on"] = serving
        return Imported(name, graph, self.notes)

    def _planner(self) -> dict[str, Any]:
        """Dynamo's Planner as `autoscale` on the prefill and decode pools (dynamo_planner.py);
        the graph settings it gives (`max_gpus`)."""
        if not self.planners:
            return {}
        where, flags = self.planners[0]
        self.notes += [f"{w}: a second Planner not imported" for w, _ in self.planners[1:]]
        pools = {c["role"]: c for c in self.components.values() if c.get("role") in ("prefill", "decode")}
        split = [c for c in self.components.values() if c.get("role") in ("prefill", "decode")]
        graph, notes = read_planner(flags, pools if len(split) == 2 else {}, where)
        self.notes += notes
        return graph

    def _differing(self, what: str, seen: Counter[str]) -> None:
        if len(seen) > 1:
            kept = seen.most_common(1)[0][0]
            self.notes.append(f"services use several {what}s ({', '.join(sorted(seen))}); kept {kept}")

    def _env(self, where: str, envs: list[dict[str, Any]]) -> dict[str, str]:
        env = {}
        for var in envs:
            if "value" in var:
                env[var["name"]] = str(var["value"])
            else:
                self.notes.append(
                    f"{where} {var.get('name')}: from {var.get('valueFrom')}; set it in the env"
                )
        return env

    def _service(self, name: str, service: dict[str, Any]) -> None:
        where = f"services.{name}"
        key = _name(name)
        module, args = command_line((service.get("extraPodSpec") or {}).get("mainContainer") or {})
        if service.get("componentType") == "planner" or module in PLANNER_MODULES:
            self.planners.append((where, parse_flags(args)))
            if service.get("envs") or service.get("envFromSecret"):
                self.notes.append(f"{where}: the Planner's env not imported (the graph's planner needs none)")
            return
        for extra in sorted(set(service) - _SERVICE_KEYS - {"resources", "extraPodSpec", "multinode"}):
            self.notes.append(f"{where}.{extra}: not imported")
        pod = service.get("extraPodSpec") or {}
        for extra in sorted(set(pod) - {"mainContainer"}):
            self.notes.append(f"{where}.extraPodSpec.{extra}: not imported")
        container = pod.get("mainContainer") or {}
        for extra in sorted(set(container) - _CONTAINER_KEYS):
            self.notes.append(f"{where}.extraPodSpec.mainContainer.{extra}: not imported")
        if container.get("image"):
            self.images[container["image"]] += 1
        if service.get("dynamoNamespace"):
            self.namespaces[service["dynamoNamespace"]] += 1
        if service.get("envFromSecret"):
            self.env_secrets[service["envFromSecret"]] += 1
        env = {
            **self.graph_env,
            **self._env(f"{where}.envs", service.get("envs") or []),
            **self._env(f"{where}.extraPodSpec.mainContainer.env", container.get("env") or []),
        }
        kind = service.get("componentType")
        if kind in ("frontend", "main") or module == "dynamo.frontend":
            comp = self._frontend(where, args, env)
            if int(service.get("replicas", 1)) != 1:
                comp["replicas"] = int(service["replicas"])
        elif kind == "worker" or module in {b.module for b in BACKENDS.values()}:
            comp = self._worker(where, service, module, args, container.get("workingDir"))
            if container.get("workingDir"):
                self.working_dirs[container["workingDir"]] += 1
        else:
            self.notes.append(
                f"{where}: componentType {kind!r} ({module or 'no python module'}) not imported"
            )
            return
        if env:
            comp["env"] = dict(sorted(env.items()))
        self.components[key] = comp

    def _frontend(self, where: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
        router: dict[str, Any] = {}
        comp: dict[str, Any] = {"kind": "frontend", "http": {"port": 8000}}  # Dynamo's default port
        mode = env.pop("DYN_ROUTER_MODE", None)
        for flag, value in parse_flags(args):
            if flag == "--router-mode":
                mode = value
            elif flag == "--http-port" and value is not None:
                comp["http"]["port"] = int(value)
            elif flag in _ROUTER_FLAGS and value is not None:
                key, convert = _ROUTER_FLAGS[flag]
                try:
                    router[key] = convert(value)
                except ValueError as err:
                    self.notes.append(f"{where}: frontend flag {flag} {value}: {err}; not imported")
            elif flag in ("--no-kv-events", "--no-router-kv-events"):
                router["use_kv_events"] = False
            elif flag in ("--kv-events", "--router-kv-events"):
                router["use_kv_events"] = True
            elif flag == "--migration-limit" and value is not None:
                comp["migration_limit"] = int(value)
            elif flag == "--enforce-disagg":
                comp.setdefault("disagg", {})["enforce"] = True
            elif flag == "--router-conditional-disagg":
                comp.setdefault("disagg", {})["conditional"] = True
            else:
                self.notes.append(f"{where}: frontend flag {_spell(flag, value)} has no graph setting")
        if mode in _ROUTER_MODES:
            router["mode"] = mode
        elif mode is not None:
            self.notes.append(f"{where}: router mode {mode!r} is not one of {', '.join(_ROUTER_MODES)}")
        if mode == "kv":
            self.notes.append(
                f"{where}: Dynamo's frontend routes by its block cost; the graph gets dyngraph's "
                "predictive cost (router.cost: dynamo for Dynamo's)"
            )
        if router:
            comp["router"] = router
        return comp

    def _worker(
        self, where: str, service: dict[str, Any], module: str | None, args: list[str], workdir: str | None
    ) -> dict[str, Any]:
        engine = next((name for name, b in BACKENDS.items() if b.module == module), None)
        if engine is None:
            raise DgdError(
                f"{where}: worker command {module or args[:1]} is not one of "
                f"{', '.join('python3 -m ' + b.module for b in BACKENDS.values())}"
            )
        backend = BACKENDS[engine]
        settings = _WorkerFlags(backend, where, self.notes)
        for flag, value in parse_flags(args):
            settings.take(backend.aliases.get(flag, flag), value)
        role = service.get("subComponentType") or settings.role or "agg"
        if settings.role and service.get("subComponentType") and settings.role != role:
            self.notes.append(f"{where}: subComponentType {role} wins over the flags' {settings.role}")
        if settings.config_file is not None:
            self._engine_config(where, settings, workdir)
        if role != "agg":
            self._implicit_kv_transfer(where, engine, settings)
        elif settings.connector is not None:
            self.notes.append(
                f"{where}: --connector {settings.connector} not imported (an aggregated worker)"
            )
        model = self._model(where, settings)
        comp: dict[str, Any] = {
            "kind": "worker",
            "model": model,
            "engine": engine,
            "role": role,
            "replicas": int(service.get("replicas", 1)),
        }
        gpus = _gpus(service.get("resources") or {}, where, self.notes)
        nodes = int((service.get("multinode") or {}).get("nodeCount", 1))
        if nodes > 1:  # a replica over nodes: its GPUs are all its nodes' (graph `nodes`)
            comp["nodes"] = nodes
            gpus *= nodes
        if gpus or settings.tensor_parallel > 1:
            comp["gpus"] = {"per_replica": gpus, "tensor_parallel_size": settings.tensor_parallel}
        if settings.migration_limit:
            comp["migration_limit"] = settings.migration_limit
        if settings.engine_args:
            comp["engine_args"] = dict(sorted(settings.engine_args.items()))
        return comp

    def _engine_config(self, where: str, flags: _WorkerFlags, workdir: str | None) -> None:
        """TensorRT-LLM's `--extra-engine-args FILE`: its settings (LLM API arguments, the
        cache_transceiver_config a prefill/decode worker needs) read into engine_args, which the
        renderer writes back as `--override-engine-args`; unreadable, the path is kept."""
        path = flags.config_file
        assert path is not None
        found = find_local_file(path, workdir, self.files)
        loaded: Any = None
        if found is not None:
            try:
                loaded = yaml.safe_load(found.read_text())
            except (OSError, yaml.YAMLError) as err:
                self.notes.append(f"{where}: engine config {path}: cannot read {found}: {err}")
        if not isinstance(loaded, dict):
            if found is None:
                self.notes.append(
                    f"{where}: engine config {path} (in the container's {workdir or '/'}) not found next "
                    "to the DGD; kept as engine_args.extra_engine_args, its settings "
                    "(cache_transceiver_config) unknown here"
                )
            flags.engine_args["extra_engine_args"] = path
            return
        for key, value in loaded.items():
            flags.engine_args.setdefault(key, value)  # flags given beside the file win
        transceiver = loaded.get("cache_transceiver_config")
        self.notes.append(
            f"{where}: engine config {path} read from {found.name} into engine_args"
            + (f" (cache_transceiver_config: {json.dumps(transceiver)})" if transceiver else "")
        )

    def _implicit_kv_transfer(self, where: str, engine: str, flags: _WorkerFlags) -> None:
        """What moves a prefill/decode worker's KV when its DGD does not say: Dynamo's defaults."""
        args = flags.engine_args
        if engine == "vllm" and "kv_transfer_config" in args and flags.connector is not None:
            self.notes.append(
                f"{where}: --connector {flags.connector} not imported "
                "(its --kv-transfer-config names the connector)"
            )
        elif engine == "vllm" and "kv_transfer_config" not in args:
            if flags.connector in (None, "nixl"):
                args["kv_transfer_config"] = dict(VLLM_DEFAULT_CONNECTOR)
                self.notes.append(
                    f"{where}: made explicit: engine_args.kv_transfer_config "
                    f"{json.dumps(VLLM_DEFAULT_CONNECTOR)} (Dynamo's vLLM worker uses NIXL when its DGD "
                    "names no connector)"
                )
            else:
                self.notes.append(
                    f"{where}: --connector {flags.connector}: no KV connector for a {engine} worker"
                )
        elif engine == "sglang" and "disaggregation_transfer_backend" not in args:
            args["disaggregation_transfer_backend"] = SGLANG_DEFAULT_TRANSFER_BACKEND
            self.notes.append(
                f"{where}: made explicit: engine_args.disaggregation_transfer_backend "
                f"{SGLANG_DEFAULT_TRANSFER_BACKEND} (SGLang's default)"
            )

    def _model(self, where: str, flags: _WorkerFlags) -> str:
        """The key of the worker's model; workers of one model share its entry."""
        if flags.path is None:
            raise DgdError(f"{where}: the worker names no model ({flags.backend.model_path})")
        served = flags.name or flags.path  # Dynamo serves a model under its path by default
        model: dict[str, Any] = {"path": flags.path, "name": served}
        if flags.context_length:
            model["context_length"] = flags.context_length
        if flags.block_size:
            model["kv_cache_block_size"] = flags.block_size
        key = _name(served.rsplit("/", 1)[-1])
        known = self.models.setdefault(key, model)
        if known != model:
            self.notes.append(f"{where}: model settings {model} differ from {known}; kept the first")
        return key


def _spell(flag: str, value: str | None) -> str:
    return flag if value is None else f"{flag} {value}"


def _gpus(resources: dict[str, Any], where: str, notes: list[str]) -> int:
    count = 0
    for kind in sorted(resources):
        for resource, value in sorted((resources[kind] or {}).items()):
            if resource == "gpu":
                count = max(count, int(str(value)))
            else:
                notes.append(f"{where}.resources.{kind}.{resource}: {value} not imported")
    return count


class _WorkerFlags:
    """One worker's flags, sorted into graph settings and engine_args."""

    def __init__(self, backend: Backend, where: str, notes: list[str]) -> None:
        self.backend, self.where, self.notes = backend, where, notes
        self.path: str | None = None
        self.name: str | None = None
        self.context_length: int | None = None
        self.block_size: int | None = None
        self.tensor_parallel = 1
        self.migration_limit = 0
        self.role: str | None = None
        self.connector: str | None = None  # Dynamo's vLLM `--connector`
        self.config_file: str | None = None  # TensorRT-LLM's `--extra-engine-args`
        self.engine_args: dict[str, Any] = {}
        self.by_flag = {flag: key for key, flag in backend.engine_arg_flags.items()}

    def take(self, flag: str, value: str | None) -> None:
        b = self.backend
        if flag == b.model_path:
            self.path = value
        elif flag == b.model_name:
            self.name = value
        elif flag == b.context_length and value is not None:
            self.context_length = int(value)
        elif flag == b.block_size and value is not None:
            self.block_size = int(value)
        elif flag == b.tensor_parallel and value is not None:
            self.tensor_parallel = int(value)
        elif flag == "--migration-limit" and b.migration_limit and value is not None:
            self.migration_limit = int(value)
        elif flag in ROLE_FLAGS and value is None:
            self.role = ROLE_FLAGS[flag]
        elif flag == "--disaggregation-mode" and value in ("agg", "prefill", "decode"):
            self.role = value
        elif flag in b.implied and value is None:
            pass  # what our workers do anyway
        elif flag == "--connector" and b.module == "dynamo.vllm" and value in ("nixl", "none"):
            self.connector = value
        elif flag == "--extra-engine-args" and b.override_flag and value is not None:
            self.config_file = value
        elif flag == b.override_flag and value is not None:
            overrides = _scalar(value)
            if isinstance(overrides, dict):
                self.engine_args.update(overrides)
            else:
                self._engine_arg(flag, value)
        elif not flag:
            self.notes.append(f"{self.where}: positional argument {value!r} not imported")
        else:
            self._engine_arg(flag, value)

    def _engine_arg(self, flag: str, value: str | None) -> None:
        if flag in self.by_flag and value is not None:  # an engine arg the renderer spells so
            self.engine_args[self.by_flag[flag]] = _scalar(value)
            return
        key = flag.lstrip("-").replace("-", "_")
        if value is None and key.startswith("no_"):
            key = key.removeprefix("no_")
            self.engine_args[key] = False
        else:
            self.engine_args[key] = True if value is None else _scalar(value)
        self.notes.append(f"{self.where}: {_spell(flag, value)} kept as engine_args.{key}")
