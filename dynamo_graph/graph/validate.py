"""Validation of a composed graph: the schema (schema.py) first, then checks that span keys.

`validate_graph` is the one entry point. It reports every problem it finds at once, each with its
dotted key path and the file:line it came from (via the loader's source map), as a `GraphError`.
Schema problems come first; the cross-key checks need a well-typed graph, so they run once the
schema is satisfied. Each cross-key check is a small function from `Graph` to problems.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from dynamo_graph.engines.registry import (
    DECODE_ONLY_ENGINES,
    GPU_FREE_ENGINES,
    KV_CONNECTOR_ENGINES,
    KV_EVENT_ENGINES,
    KV_TRANSFER_ENGINES,
    engine_file,
)
from dynamo_graph.graph.errors import GraphError, Location, Problem, did_you_mean
from dynamo_graph.graph.schema import (
    LOCAL,
    Frontend,
    Graph,
    Worker,
)


class SourceLocator(Protocol):
    """Where a key path came from (the loader's `SourceMap` is one)."""

    def locate(self, path: str) -> Location | None: ...


def validate_graph(
    data: Any, source: SourceLocator | None, *, file: str, engines: Engines = "dyngraph"
) -> Graph:
    """The validated graph, or GraphError with every problem found."""
    try:
        graph = Graph.model_validate(data)
    except ValidationError as e:
        problems = _schema_problems(e.errors(), data)
    else:
        checks = [c for c in CHECKS if engines == "dyngraph" or c not in _DYNGRAPH_ENGINES_ONLY]
        problems = [p for check in checks for p in check(graph)]
    if problems:
        raise GraphError([locate(p, source, file) for p in problems])
    return graph


def locate(problem: Problem, source: SourceLocator | None, file: str) -> Problem:
    """Attach the location of the path, or of its nearest parent that has one, else the file."""
    path = problem.path
    while source is not None:
        if (location := source.locate(path)) is not None:
            return Problem(problem.path, problem.message, location)
        if not path:
            break
        path = path.rpartition(".")[0]
    return Problem(problem.path, problem.message, Location(file))


# ---------------------------------------------------------------------------------------------
# Schema errors -> problems
# ---------------------------------------------------------------------------------------------

_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping (key: value)",
    "model_type": "a mapping (key: value)",
    "model_attributes_type": "a mapping (key: value)",
}
_BOUNDS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def _schema_problems(errors: list[ErrorDetails], data: Any) -> list[Problem]:
    """A problem per error, but one for a value that fits no member of a union (`port: 99999` is
    neither a port number nor `auto`), saying what each member wanted."""
    unions: dict[tuple[str | int, ...], list[ErrorDetails]] = defaultdict(list)
    for err in errors:
        if (path := _union_value(err, data)) is not None:
            unions[path].append(err)
    problems = []
    for err in errors:
        path = _union_value(err, data)
        group = unions.get(path) if path is not None else None
        if group is None or len(group) < 2:
            problems.append(_schema_problem(err, data))
        elif group[0] is err:
            wanted = " or ".join(_wanted(e) for e in group)
            problems.append(Problem(_dotted(path), f"must be {wanted}, got {_describe(err['input'])}"))
    return problems


def _union_value(err: ErrorDetails, data: Any) -> tuple[str | int, ...] | None:
    """The path of the value when pydantic reports `err` against one member of a union (its loc
    then ends in the member's tag, e.g. `constrained-int`, under a plain value), else None."""
    path = _without_tags(list(err["loc"]), data)
    node = data
    for part in path[:-1]:
        listed = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if not (isinstance(node, dict) and part in node) and not listed:
            return None
        node = node[part]
    return None if isinstance(node, (dict, list)) or len(path) < 2 else tuple(path[:-1])


def _wanted(err: ErrorDetails) -> str:
    """What one member of a union wanted, as `must be ...` continues."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        return f"{op} {ctx[bound]}"
    if kind == "literal_error":
        return " or ".join(re.findall(r"'([^']*)'", ctx.get("expected", "")))
    return _TYPE_NAMES.get(kind) or err["msg"][:1].lower() + err["msg"][1:]


def _schema_problem(err: ErrorDetails, data: Any) -> Problem:
    loc = list(err["loc"])
    ctx = err.get("ctx") or {}
    kind = err["type"]
    message = err["msg"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        message = f"unknown key {key!r}" + did_you_mean(key, _fields_at(loc[:-1]), listing=True)
    elif kind == "missing":
        message = "required key is missing"
    elif kind in _TYPE_NAMES:
        message = f"expected {_TYPE_NAMES[kind]}, got {_describe(err['input'])}"
    elif kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", ctx.get("expected", ""))
        message = f"{_describe(err['input'])} is not one of {', '.join(allowed)}" + did_you_mean(
            str(err["input"]), allowed
        )
    elif kind in ("union_tag_invalid", "union_tag_not_found"):
        loc.append("kind")
        if kind == "union_tag_invalid":
            tag = str(ctx["tag"])
            message = f"unknown kind {tag!r}; expected frontend or worker" + did_you_mean(
                tag, ["frontend", "worker"]
            )
        else:
            message = "required key is missing: `kind: frontend` or `kind: worker`"
    elif kind == "graph_field":
        loc.extend(str(ctx["field"]).split("."))
        message = str(ctx["message"])
    elif kind == "value_error":
        message = str(ctx["error"])
    elif kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        message = f"must be {op} {ctx[bound]}, got {_describe(err['input'])}"
    elif kind == "too_short":
        message = f"needs at least {ctx['min_length']} item(s)"
    elif kind == "string_pattern_mismatch":
        message = f"{_describe(err['input'])} must be letters, digits, '_' or '-' (no dots)"
    if "[key]" in loc:
        # An invalid mapping key: pydantic reports it under the key, then a "[key]" marker.
        loc = loc[: loc.index("[key]")]
        message = f"invalid name: {message}"
    return Problem(_dotted(_without_tags(loc, data)), message)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return repr(value)


def _dotted(loc: Iterable[str | int]) -> str:
    return ".".join(str(part) for part in loc)


def _without_tags(loc: list[str | int], data: Any) -> list[str | int]:
    """Drop the tag pydantic puts into paths through a tagged union (`components.x.worker.y`),
    by walking the data: a tag is a part that names the node's `kind` but is not one of its keys."""
    out: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("kind") == part:
            continue
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return out


def schema_keys(path: str) -> list[str] | None:
    """The keys the schema has under dotted `path`: a section's field names; None where the keys
    are names the graph picks (models, components, hosts) or free (engine_args, env); [] under a
    plain value."""
    node: Any = Graph
    for part in path.split(".") if path else ():
        node = _step(node, int(part) if part.isdigit() else part)
        if node is None:
            return []
    tp = _unannotated(node)
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    members = [_unannotated(m) for m in (typing.get_args(tp) if union else (tp,))]
    if any(m is Any or typing.get_origin(m) is dict for m in members):
        return None
    return sorted({name for m in members if _is_model(m) for name in m.model_fields})


def schema_knows(path: str) -> bool:
    """Whether the graph schema has the dotted key `path` (names of models, components and hosts
    are free, and a component's keys are those of any kind)."""
    node: Any = Graph
    for part in path.split("."):
        node = _step(node, int(part) if part.isdigit() else part)
        if node is None:
            return False
    return True


def _fields_at(loc: list[str | int]) -> list[str]:
    """Field names of the model at a pydantic error path, for did-you-mean on unknown keys."""
    node: Any = Graph
    for part in loc:
        node = _step(node, part)
        if node is None:
            return []
    model = _model_in(node)
    return list(model.model_fields) if model else []


def _step(tp: Any, part: str | int) -> Any:
    tp = _unannotated(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(tp)
        for member in members:  # a tagged union: the path names the member by its `kind`
            kind = member.model_fields.get("kind") if _is_model(member) else None
            if kind is not None and kind.annotation == typing.Literal[part]:
                return member
        return next((s for m in members if (s := _step(m, part)) is not None), None)
    if origin is dict:
        return typing.get_args(tp)[1]
    if origin is list:
        return typing.get_args(tp)[0]
    if _is_model(tp) and isinstance(part, str) and part in tp.model_fields:
        return tp.model_fields[part].annotation
    return None


def _model_in(tp: Any) -> type[BaseModel] | None:
    tp = _unannotated(tp)
    if _is_model(tp):
        return tp
    models = [m for m in typing.get_args(tp) if _is_model(m)]
    return models[0] if len(models) == 1 else None


def _unannotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


# ---------------------------------------------------------------------------------------------
# Checks across keys
# ---------------------------------------------------------------------------------------------


def check_unique_names(graph: Graph) -> Iterator[Problem]:
    """Served model names and worker endpoints must be unique: clients and routers find them by
    name, and two components on one endpoint would silently share one pool."""
    served: dict[str, str] = {}
    for key, model in graph.models.items():
        assert model.name is not None
        if model.name in served:
            yield Problem(
                f"models.{key}.name",
                f"served name {model.name!r} is already used by models.{served[model.name]}",
            )
        served.setdefault(model.name, key)
    endpoints: dict[str, str] = {}
    for key, worker in graph.workers().items():
        assert worker.endpoint is not None
        if worker.endpoint in endpoints:
            yield Problem(
                f"components.{key}.endpoint",
                f"{worker.endpoint} is already the endpoint of components.{endpoints[worker.endpoint]}",
            )
        endpoints.setdefault(worker.endpoint, key)


def check_references(graph: Graph) -> Iterator[Problem]:
    """Models, hosts and components named anywhere must exist."""
    hosts = {LOCAL, *graph.hosts}
    for key, comp in graph.components.items():
        where = f"components.{key}"
        if isinstance(comp, Worker):
            yield from _dangling(f"{where}.model", comp.model, graph.models, "model")
            for i, host in enumerate(comp.placement):
                yield from _dangling(f"{where}.placement.{i}", host, hosts, "host")
        else:
            yield from _dangling(f"{where}.host", comp.host, hosts, "host")
            for i, model in enumerate(comp.models or []):
                yield from _dangling(f"{where}.models.{i}", model, graph.models, "model")
        for i, dep in enumerate(comp.depends_on):
            if dep == key:
                yield Problem(f"{where}.depends_on.{i}", "a component cannot depend on itself")
            else:
                yield from _dangling(f"{where}.depends_on.{i}", dep, graph.components, "component")


def _dangling(path: str, name: str, known: Iterable[str], what: str) -> Iterator[Problem]:
    known = list(known)
    if name not in known:
        yield Problem(path, f"no {what} named {name!r}" + did_you_mean(name, known, listing=True))


def check_tests(graph: Graph) -> Iterator[Problem]:
    """Smoke checks name a frontend that exists, a model it serves, and a component to fault."""
    frontends = graph.frontends()
    for i, check in enumerate(graph.tests or []):
        where = f"tests.{i}"
        if check.frontend is not None:
            yield from _dangling(f"{where}.frontend", check.frontend, frontends, "frontend")
        elif not frontends:
            yield Problem(where, "the graph has no frontend to send checks to")
        frontend = frontends.get(check.frontend or next(iter(frontends), ""))
        request = check.chat or check.completion
        if frontend is not None and request is not None and request.model is not None:
            served = [graph.models[k].name or k for k in frontend.models or graph.models if k in graph.models]
            yield from _dangling(f"{where}.{check.kind}.model", request.model, served, "model served")
        if check.fault is not None:
            yield from _dangling(f"{where}.fault.kill", check.fault.kill, graph.components, "component")


def check_test_faults(graph: Graph) -> Iterator[Problem]:
    """A fault's replica runs. Checked by `dyngraph test` only: `up` or a `bench --sweep` may
    well run fewer replicas than the graph's checks were written for."""
    for i, check in enumerate(graph.tests or []):
        fault = check.fault
        comp = graph.components.get(fault.kill) if fault is not None else None
        if fault is not None and comp is not None and fault.replica >= comp.replicas:
            message = f"{fault.kill} runs {comp.replicas} replica(s), counted from 0"
            yield Problem(f"tests.{i}.fault.replica", message)


def check_cycles(graph: Graph) -> Iterator[Problem]:
    """`depends_on` must order the components: a cycle could never start."""
    deps = {
        key: [d for d in comp.depends_on if d in graph.components and d != key]
        for key, comp in graph.components.items()
    }
    done: set[str] = set()
    for start in deps:
        stack: list[str] = []
        yield from _find_cycles(start, deps, stack, done)


def _find_cycles(
    node: str, deps: dict[str, list[str]], stack: list[str], done: set[str]
) -> Iterator[Problem]:
    if node in done:
        return
    if node in stack:
        cycle = [*stack[stack.index(node) :], node]
        yield Problem(f"components.{cycle[-2]}.depends_on", f"dependency cycle: {' -> '.join(cycle)}")
        return
    stack.append(node)
    for dep in deps[node]:
        yield from _find_cycles(dep, deps, stack, done)
    stack.pop()
    done.add(node)


def check_kv_events(graph: Graph) -> Iterator[Problem]:
    """A kv router that follows KV events needs workers that publish them, over a plane that
    reaches the frontend's process."""
    workers = graph.workers()
    for key, frontend in graph.frontends().items():
        router = frontend.router
        if router.mode != "kv" or not router.use_kv_events:
            continue
        served = frontend.models if frontend.models is not None else list(graph.models)
        for wkey, worker in workers.items():
            # A Python engine file may publish events through the API; it gets the benefit of the doubt.
            silent = worker.engine not in KV_EVENT_ENGINES and engine_file(worker.engine) is None
            if worker.model in served and silent:
                yield Problem(
                    f"components.{key}.router.mode",
                    f"kv routing follows KV events, but worker {wkey!r} (engine {worker.engine}) publishes "
                    f"none; use an engine that does ({', '.join(sorted(KV_EVENT_ENGINES))}) or set "
                    "router.use_kv_events: false",
                )
        if graph.runtime.event_plane == "inproc":
            yield Problem(
                "runtime.event_plane",
                f"components.{key} routes by KV events, which `inproc` cannot carry between processes; "
                "use zmq or nats",
            )


def check_gpus(graph: Graph) -> Iterator[Problem]:
    """GPU requests, placed replica by replica, must fit each host's declared GPUs, and GPUs named
    by id must exist and not be claimed twice."""
    total: dict[str, int] = defaultdict(int)
    reported: set[str] = set()
    claimed: dict[str, dict[int, str]] = defaultdict(dict)
    for key, worker in graph.workers().items():
        gpus = worker.gpus
        if gpus.per_replica == 0:
            continue
        where = f"components.{key}.gpus"
        per_host: dict[str, int] = defaultdict(int)
        for host in worker.hosts_of_replicas():
            per_host[host] += 1
        for host, replicas in per_host.items():
            if host != LOCAL and host not in graph.hosts:
                continue  # reported by check_references
            have = graph.host(host).gpus
            need = replicas * worker.gpus_per_node
            total[host] += need
            if total[host] > have and host not in reported:
                reported.add(host)
                yield Problem(f"{where}.per_replica", _gpu_shortfall(host, have, need, total[host]))
            ids = _explicit_ids(worker, replicas)
            if ids is None:
                continue
            if gpus.gpu_ids is not None and len(gpus.gpu_ids) < need:
                yield Problem(
                    f"{where}.gpu_ids",
                    f"{replicas} replica(s) on host {host!r} × {worker.gpus_per_node} GPUs need {need} ids, "
                    f"{len(gpus.gpu_ids)} given",
                )
            field = "gpu_ids" if gpus.gpu_ids is not None else "base_gpu_id"
            if missing := sorted(i for i in ids if i >= have):
                yield Problem(
                    f"{where}.{field}", f"host {host!r} has {have} GPU(s); no GPU {missing[0]} there"
                )
            if taken := sorted(i for i in ids if i in claimed[host]):
                yield Problem(
                    f"{where}.{field}",
                    f"GPU {taken[0]} on host {host!r} is also used by {claimed[host][taken[0]]}",
                )
            claimed[host].update(dict.fromkeys(ids, f"components.{key}"))
    if graph.max_gpus is not None and sum(total.values()) > graph.max_gpus:
        yield Problem(
            "max_gpus", f"the workers' replicas use {sum(total.values())} GPUs, more than {graph.max_gpus}"
        )


def _gpu_shortfall(host: str, have: int, need: int, total: int) -> str:
    if have == 0 and host == LOCAL:
        return (
            f"asks for {need} GPU(s) on host 'local', which declares none; set hosts.local.gpus to the "
            "number of GPUs this machine has"
        )
    others = f" ({total} with the components before it)" if total != need else ""
    return f"asks for {need} GPU(s) on host {host!r}{others}, which has {have}"


def _explicit_ids(worker: Worker, replicas: int) -> set[int] | None:
    """GPU ids a worker names on a host it runs `replicas` replicas on, if it names any."""
    gpus, per = worker.gpus, worker.gpus_per_node
    if gpus.gpu_ids is not None:
        return set(gpus.gpu_ids[: replicas * per])
    if gpus.base_gpu_id is not None:
        return set(range(gpus.base_gpu_id, gpus.base_gpu_id + replicas * per))
    return None


def check_ports(graph: Graph) -> Iterator[Problem]:
    """Fixed ports on one host must differ: HTTP ports, workers' tcp and metrics ports, managed infra (which
    runs on the local host). Bind addresses are ignored: 127.0.0.1 and 0.0.0.0 still clash."""
    owners: dict[tuple[str, int], str] = {}
    for host, port, path in fixed_ports(graph):
        if (host, port) in owners:
            yield Problem(path, f"port {port} on host {host!r} is already used by {owners[host, port]}")
        else:
            owners[host, port] = path


def fixed_ports(graph: Graph) -> Iterator[tuple[str, int, str]]:
    """(host, port, key path) of every port the graph pins (preflight checks they are free)."""
    etcd, nats = graph.infra.etcd, graph.infra.nats
    if etcd is not None and etcd.managed:
        for field in ("client_port", "peer_port"):
            if isinstance(port := getattr(etcd, field), int):
                yield LOCAL, port, f"infra.etcd.{field}"
    if nats is not None and nats.managed and isinstance(nats.port, int):
        yield LOCAL, nats.port, "infra.nats.port"
    for key, comp in graph.components.items():
        if isinstance(comp, Frontend):
            if isinstance(comp.http.port, int):
                yield comp.host, comp.http.port, f"components.{key}.http.port"
        else:
            for field in ("tcp_port", "metrics_port"):
                if isinstance(port := getattr(comp, field), int):
                    for i, host in enumerate(comp.hosts_of_replicas()):
                        yield host, port + i, f"components.{key}.{field}"


def check_disagg(graph: Graph) -> Iterator[Problem]:
    """Disaggregated serving needs both halves: prefill workers hand the KV cache to decode ones,
    with an engine that can (by itself, or by its own KV connector, configured)."""
    roles: dict[str, dict[str, str]] = defaultdict(dict)
    for key, worker in graph.workers().items():
        roles[worker.model].setdefault(worker.role, key)
    for model, by_role in roles.items():
        for have, lack in (("prefill", "decode"), ("decode", "prefill")):
            if have in by_role and lack not in by_role:
                yield Problem(
                    f"components.{by_role[have]}.role",
                    f"model {model!r} has a {have} worker but no {lack} worker; add a worker with "
                    f"role: {lack} for it, or make this one role: agg",
                )


def check_kv_transfer(graph: Graph) -> Iterator[Problem]:
    """Our engine adapters that can hand a prompt's KV cache from a prefill to a decode worker.
    Dynamo's own backends (vLLM, SGLang, TensorRT-LLM over NIXL) can, so a graph rendered for
    Dynamo's operator skips this check (`validate_graph(..., engines="dynamo")`)."""
    for key, worker in graph.workers().items():
        # A Python engine file may implement the KV transfer contract; it gets the benefit of the doubt.
        from_file = engine_file(worker.engine) is not None
        if worker.role == "agg" or worker.engine in KV_TRANSFER_ENGINES or from_file:
            continue
        if worker.engine in KV_CONNECTOR_ENGINES:
            problem = _missing_kv_connector(key, worker)
            if problem is not None:
                yield problem
            continue
        able = sorted({*KV_TRANSFER_ENGINES, *KV_CONNECTOR_ENGINES})
        yield Problem(
            f"components.{key}.engine",
            f"role {worker.role} needs an engine that hands the prompt's KV cache from prefill to "
            f"decode workers ({', '.join(able)}); {worker.engine} cannot",
        )
    decode_only = sorted(
        k for k, w in graph.workers().items() if w.role == "decode" and w.engine in DECODE_ONLY_ENGINES
    )
    for key, frontend in graph.frontends().items():
        if decode_only and frontend.disagg.conditional:
            yield Problem(
                f"components.{key}.disagg.conditional",
                f"conditional disaggregation prefills short prompts on the decode workers, and "
                f"{', '.join(decode_only)} cannot ({graph.workers()[decode_only[0]].engine}'s decode "
                "engine only continues from a prefill worker's KV)",
            )


def _missing_kv_connector(key: str, worker: Worker) -> Problem | None:
    """A worker of an engine with its own KV connector, as prefill/decode: a Problem unless its
    engine args configure the connector (an engine_args_file is not read here: the worker checks
    it when it starts)."""
    if worker.engine_args_file is not None:
        return None
    setting, example = KV_CONNECTOR_ENGINES[worker.engine]
    value = (worker.engine_args or {}).get(setting)
    if worker.engine == "vllm":  # vLLM's KVTransferConfig, an object or its JSON: it names the connector
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = None
        configured = isinstance(value, dict) and bool(value.get("kv_connector"))
    else:
        configured = bool(value)
    if configured:
        return None
    what = f"{setting} with a kv_connector" if worker.engine == "vllm" else setting
    return Problem(
        f"components.{key}.engine_args",
        f"role {worker.role}: {worker.engine} moves the KV cache with its own connector; add {what} "
        f"to engine_args, e.g. {setting}: {example}",
    )


def check_planes(graph: Graph) -> Iterator[Problem]:
    """Planes need their services declared; static workers need fixed tcp ports."""
    runtime, infra = graph.runtime, graph.infra
    if runtime.discovery == "etcd" and infra.etcd is None:
        yield Problem("runtime.discovery", "etcd discovery needs infra.etcd (`managed: true` or `endpoints`)")
    for plane in ("request_plane", "event_plane"):
        if getattr(runtime, plane) == "nats" and infra.nats is None:
            yield Problem(f"runtime.{plane}", "the nats plane needs infra.nats (`managed: true` or `url`)")
    for key, worker in graph.workers().items():
        if not worker.static:
            continue
        if runtime.request_plane != "tcp":
            yield Problem(f"components.{key}.static", "static workers serve on the tcp request plane only")
        if worker.tcp_port is None:
            yield Problem(f"components.{key}.static", "a static worker needs a fixed `tcp_port`")


def check_multi_host(graph: Graph) -> Iterator[Problem]:
    """Components on several hosts need shared discovery (etcd), request and event planes that
    cross machines (nats, or tcp / zmq with an address other hosts reach each worker host at),
    and infra the remote hosts can reach."""
    remote = sorted(h for h in _hosts_used(graph) if h != LOCAL and h in graph.hosts)
    if not remote:
        return
    why = f"components run on host {remote[0]!r}"
    if graph.runtime.discovery != "etcd":
        yield Problem("runtime.discovery", f"{why}: use `discovery: etcd` (file discovery is one machine)")
    kv_routed = [k for k, f in graph.frontends().items() if f.router.mode == "kv" and f.router.use_kv_events]
    # Workers listen on their host's address on the tcp request plane, and zmq KV publishers bind
    # the same address: both need one that the other hosts reach.
    needs_address = []
    if graph.runtime.request_plane == "tcp":
        needs_address.append("the tcp request plane")
    if graph.runtime.event_plane == "zmq" and kv_routed:
        needs_address.append(f"KV events over zmq (components.{kv_routed[0]} routes by them)")
    if needs_address and graph.slurm is None:  # on Slurm, the job's nodes give the addresses
        worker_hosts = {h for w in graph.workers().values() for h in w.placement}
        for host in sorted(worker_hosts & {LOCAL, *graph.hosts}):
            spec = graph.host(host)
            if spec.advertise_host is None and spec.ssh is None:
                yield Problem(
                    f"hosts.{host}.advertise_host",
                    f"{why}: {' and '.join(needs_address)} {'need' if len(needs_address) > 1 else 'needs'} "
                    f"the address other hosts reach {host!r} at (or use nats for that plane)",
                )
    etcd, nats = graph.infra.etcd, graph.infra.nats
    for name, service in (("etcd", etcd), ("nats", nats)):
        if service is None or not service.managed:
            continue
        if service.host is not None and _loopback(service.host):
            yield Problem(f"infra.{name}.host", f"{why}, which cannot reach managed {name} on {service.host}")
        elif service.host is None and graph.host(LOCAL).advertise_host is None and graph.slurm is None:
            yield Problem(
                "hosts.local.advertise_host",
                f"{why}: managed {name} needs the address other hosts reach this machine at",
            )
    external = [(f"infra.etcd.endpoints.{i}", url) for i, url in enumerate(etcd.endpoints if etcd else [])]
    if nats is not None and nats.url is not None:
        external.append(("infra.nats.url", nats.url))
    for path, url in external:
        if _loopback(urlsplit(url if "://" in url else f"//{url}").hostname or ""):
            yield Problem(path, f"{why}, which cannot reach {url}")


def check_slurm(graph: Graph) -> Iterator[Problem]:
    """On Slurm, the scheduler gives out GPUs (GRES) and hosts are nodes whose address others
    use: GPUs cannot be named by id, and a frontend on any node but the first must bind an
    address the job's first node (where readiness is checked) reaches."""
    if graph.slurm is None:
        return
    for key, worker in graph.workers().items():
        for field in ("gpu_ids", "base_gpu_id"):
            if getattr(worker.gpus, field) is not None:
                yield Problem(
                    f"components.{key}.gpus.{field}",
                    "on Slurm the scheduler picks each step's GPUs (GRES); give only `per_replica`",
                )
    first = graph.slurm_nodes()[0]
    for key, frontend in graph.frontends().items():
        if frontend.host != first and _loopback(frontend.http.host):
            yield Problem(
                f"components.{key}.http.host",
                f"host {frontend.host!r} is not the job's first node, which cannot reach "
                f"{frontend.http.host} there; bind 0.0.0.0",
            )


def check_security(graph: Graph) -> Iterator[Problem]:
    """`security.tls: required` refuses a listener that would be plain TCP."""
    if graph.security.tls != "required":
        return
    for key, worker in graph.workers().items():
        if worker.engine == "vllm" and (
            worker.role != "agg" or "kv_transfer_config" in (worker.engine_args or {})
        ):
            yield Problem(
                f"components.{key}.role",
                "`security.tls: required` allows no plaintext listener, and vLLM's NIXL side channel "
                "(its KV transfer) is plain TCP",
            )


def tls_warnings(graph: Graph) -> list[str]:
    """What `up` warns about: a graph across hosts whose traffic is unencrypted."""
    remote = sorted(h for h in _hosts_used(graph) if h != LOCAL)
    if not remote or graph.security.tls != "off":
        return []
    return [
        f"security.tls is off and the graph spans hosts ({', '.join([LOCAL, *remote])}): prompts, "
        "tokens and KV events cross the network unencrypted"
    ]


def gpu_warnings(graph: Graph) -> list[str]:
    """What `up` warns about: workers that ask for GPUs on an engine that uses none (the mocker,
    the echo engines: an imported deployment run on a laptop). Their GPUs are still handed out,
    but preflight does not require them on the host."""
    return [
        f"components.{key}.gpus: engine {worker.engine} uses no GPUs; the {worker.gpus.per_replica} "
        "per replica it asks for need not exist on its host"
        for key, worker in graph.workers().items()
        if worker.engine in GPU_FREE_ENGINES and worker.gpus.per_replica
    ]


def _hosts_used(graph: Graph) -> set[str]:
    used = set()
    for comp in graph.components.values():
        used.update(comp.placement if isinstance(comp, Worker) else [comp.host])
    return used


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


CHECKS: tuple[Callable[[Graph], Iterable[Problem]], ...] = (
    check_unique_names,
    check_references,
    check_cycles,
    check_kv_events,
    check_gpus,
    check_ports,
    check_disagg,
    check_kv_transfer,
    check_planes,
    check_multi_host,
    check_security,
    check_slurm,
    check_tests,
)

Engines = Literal["dyngraph", "dynamo"]
"""Whose engines run the workers: ours (`dyngraph run`, every target but one) or Dynamo's
(`render -f dynamo-k8s`), which changes what the engine can do, not what the graph means."""

_DYNGRAPH_ENGINES_ONLY = frozenset({check_kv_transfer})
