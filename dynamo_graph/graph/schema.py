"""The graph file's schema: pydantic models that are the single source of truth for its shape.

A graph file (after `load.py` has composed it into a plain dict) is validated against `Graph`;
`validate.py` adds the checks that span several keys (references, ports, GPUs, planes). Every
field maps onto a `dyngraph run` flag or environment variable, which is what `compile.py` turns
it into. Relative paths in a graph (model paths, engine files, engine-args files, the local
workdir) are relative to the directory of the graph file, not the current directory.

`python -m dynamo_graph.graph.schema > schemas/graph.schema.json` writes the JSON Schema that
editors use to complete graph files; a unit test fails when the committed file is stale.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dynamo_graph.engines import registry
from dynamo_graph.frontend.settings import (
    AuthSettings,
    HttpSettings,
    HttpTlsSettings,
    LimitSettings,
    RecordSettings,
)
from dynamo_graph.graph.metric_expr import parse_metric_expr
from dynamo_graph.graph.plan import LOCAL  # the host dyngraph runs on; it exists, declared or not
from dynamo_graph.graph.sections import section
from dynamo_graph.llm.reasoning import REASONING_PARSERS
from dynamo_graph.llm.tool_calls import TOOL_CALL_PARSERS
from dynamo_graph.router.config import DisaggConfig, RouterConfig
from dynamo_graph.runtime.names import DEFAULT_ENDPOINT, EndpointName
from dynamo_graph.runtime.settings import TracingSettings

ENGINES = tuple(registry.ENGINES)

# Names become parts of `dyn://namespace.component.endpoint` and of state paths, so they follow
# runtime/names.py: letters, digits, '_' and '-', no dots.
_NAME_RE = r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$"
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_API_KEY_ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")

Name = Annotated[str, Field(pattern=_NAME_RE)]
Port = Annotated[int, Field(ge=1, le=65535)]
AutoPort = Port | Literal["auto"]


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error found by a model-level check but about one field: validate.py appends `field`
    to the reported key path, so the user is pointed at the key to change."""
    return PydanticCustomError("graph_field", "{message}", {"field": field, "message": message})


def _env_name(name: str) -> str:
    if not _ENV_NAME_RE.match(name):
        raise ValueError(f"{name!r} is not an environment variable name (letters, digits, '_')")
    return name


_ADAPTER_NAME_RE = re.compile(r"^[^\s/,=]+$")


def _adapter_name(name: str) -> str:
    if not _ADAPTER_NAME_RE.match(name):
        raise ValueError(f"LoRA adapter name {name!r} may not hold spaces, '/', ',' or '='")
    return name


def _adapter_path(path: str) -> str:
    if not path or "," in path:
        raise ValueError(f"LoRA adapter path {path!r} must be non-empty and hold no ','")
    return path


def _env_value(value: Any) -> Any:
    # YAML reads `FOO: 1` and `FOO: true` as numbers and booleans; the process sees strings.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value


def _api_key_env_name(name: str) -> str:
    if not _API_KEY_ENV_RE.match(name):
        # The value may be a real secret: never echo it back.
        raise ValueError(
            "expected the name of an environment variable that holds a key (UPPER_CASE, e.g. "
            "DYN_API_KEY), never a literal key"
        )
    return name


Env = dict[Annotated[str, AfterValidator(_env_name)], Annotated[str, BeforeValidator(_env_value)]]


class _Model(BaseModel):
    """Base of every graph model: unknown keys are errors, field docstrings are editor hints."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


# ---------------------------------------------------------------------------------------------
# Runtime planes and the services behind them
# ---------------------------------------------------------------------------------------------


class RuntimePlanes(_Model):
    """How processes find each other and talk (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE,
    DYN_EVENT_PLANE); the defaults need no services and suit one machine."""

    discovery: Literal["file", "etcd"] = "file"
    """Where instances register: `file` (under the graph's state dir, one machine) or `etcd`
    (needs `infra.etcd`; required when components run on more than one host)."""
    request_plane: Literal["tcp", "nats"] = "tcp"
    """Transport for requests: `tcp` (direct connections) or `nats` (needs `infra.nats`). Across
    hosts, `tcp` needs `advertise_host` on every host that runs workers."""
    event_plane: Literal["zmq", "nats", "inproc"] = "zmq"
    """Transport for KV events and load metrics; `nats` needs `infra.nats`. `inproc` only reaches
    subscribers in the same process, so it cannot feed a kv router in another process."""
    lease_ttl_s: float = Field(10.0, gt=0)
    """Seconds a dead process's registration outlives it (DYN_LEASE_TTL)."""


class Etcd(_Model):
    """etcd for discovery: `managed: true` (dyngraph starts and stops it on the local host) or
    `endpoints` of an existing cluster."""

    managed: bool = False
    """Start etcd with the graph (Debian's `etcd` binary) and stop it with the graph."""
    endpoints: list[str] = []
    """Client URLs of an existing etcd (ETCD_ENDPOINTS), e.g. `http://10.0.0.5:2379`."""
    host: str | None = None
    """Managed only: address etcd binds; default 127.0.0.1, or `hosts.local.advertise_host` when
    components run on other hosts."""
    client_port: AutoPort = "auto"
    """Managed only: client port, or `auto` for a free one picked at launch."""
    peer_port: AutoPort = "auto"
    """Managed only: peer port, or `auto`."""

    _MANAGED_ONLY: ClassVar[tuple[str, ...]] = ("host", "client_port", "peer_port")

    @model_validator(mode="after")
    def _managed_or_external(self) -> Etcd:
        _check_managed_or_external(self, "endpoints", bool(self.endpoints))
        return self


class Nats(_Model):
    """nats-server for the request and/or event plane: `managed: true` or the `url` of one."""

    managed: bool = False
    """Start nats-server with the graph on the local host and stop it with the graph."""
    url: str | None = None
    """URL of an existing server (NATS_SERVER), e.g. `nats://10.0.0.5:4222`."""
    host: str | None = None
    """Managed only: address nats-server binds; default as for etcd."""
    port: AutoPort = "auto"
    """Managed only: client port, or `auto`."""
    jetstream: bool = False
    """Managed only: start with JetStream (`-js`), which Dynamo's own components expect."""

    _MANAGED_ONLY: ClassVar[tuple[str, ...]] = ("host", "port", "jetstream")

    @model_validator(mode="after")
    def _managed_or_external(self) -> Nats:
        _check_managed_or_external(self, "url", self.url is not None)
        return self


def _check_managed_or_external(service: Etcd | Nats, external_key: str, external: bool) -> None:
    if service.managed and external:
        raise field_error(external_key, f"give either `managed: true` or `{external_key}`, not both")
    if not service.managed and not external:
        raise field_error("managed", f"set `managed: true` or give `{external_key}` of a running server")
    if not service.managed:
        for key in service._MANAGED_ONLY:
            if key in service.model_fields_set:
                raise field_error(key, f"`{key}` applies only to `managed: true`")


class Infra(_Model):
    """Services the graph's planes need; an absent entry is not used. Managed services run on
    the local host."""

    etcd: Etcd | None = None
    """Needed when `runtime.discovery: etcd`."""
    nats: Nats | None = None
    """Needed when the request or event plane is `nats`."""


# ---------------------------------------------------------------------------------------------
# Hosts and models
# ---------------------------------------------------------------------------------------------


class Ssh(_Model):
    """How to reach a remote host (the ssh client's own config applies too)."""

    address: str
    """Host name or IP address to ssh to."""
    user: str | None = None
    """Login user; default: the ssh client's."""
    port: Port = 22
    """ssh port."""
    identity_file: str | None = None
    """Private key file (`ssh -i`)."""
    known_hosts: str | None = None
    """known_hosts file that must list the host's key; default the ssh client's
    (`~/.ssh/known_hosts`). An unknown or changed host key is refused, never accepted."""
    host_key: str | None = None
    """The host's public key pinned in the graph (`ssh-ed25519 AAAA...`, as in
    `/etc/ssh/ssh_host_ed25519_key.pub`); instead of `known_hosts`."""

    @model_validator(mode="after")
    def _one_key_source(self) -> Ssh:
        if self.known_hosts is not None and self.host_key is not None:
            raise field_error("host_key", "give either `host_key` or `known_hosts`, not both")
        if self.host_key is not None and len(self.host_key.split()) < 2:
            raise field_error("host_key", "expected `TYPE BASE64` (a line of a *.pub host key file)")
        return self


class Host(_Model):
    """A machine components are placed on. `local` is this machine and needs no `ssh`; any other
    host is reached over ssh."""

    ssh: Ssh | None = None
    """Required for every host but `local`."""
    workdir: str | None = None
    """Working directory of the processes; default the graph file's directory (local) or the
    ssh user's home (remote)."""
    python: str | None = None
    """Python interpreter that has dyngraph installed; default the current one (local) or
    `python3` (remote)."""
    venv: str | None = None
    """Virtual environment with dyngraph installed (its `bin/python` is used); instead of
    `python`."""
    env: Env = {}
    """Environment for every process on this host (components' `env` wins)."""
    gpus: int = Field(0, ge=0)
    """Number of GPUs on the host; components' GPU requests must fit. 0 on `local` unless
    declared."""
    advertise_host: str | None = None
    """Address other hosts reach this one at (DYN_TCP_ADVERTISE_HOST, managed infra). Needed for
    the tcp request plane across hosts; an ssh host defaults to its `ssh.address`."""

    @model_validator(mode="after")
    def _python_or_venv(self) -> Host:
        if self.python is not None and self.venv is not None:
            raise field_error("venv", "give either `python` or `venv`, not both")
        return self


# The parsers' own registries, so the schema's enums cannot drift from what the workers accept.
ToolCallParser = Literal[TOOL_CALL_PARSERS]  # type: ignore[valid-type]
ReasoningParser = Literal[REASONING_PARSERS]  # type: ignore[valid-type]


class Model(_Model):
    """A model served by workers (--model-path and friends)."""

    path: str
    """Hugging Face folder, GGUF file, `org/name` or `hf://org/name` (--model-path)."""
    name: str | None = None
    """Name clients ask for (--model-name); default the model's key in `models`."""
    config: str | None = None
    """Folder with tokenizer files for a GGUF (--model-config)."""
    context_length: int | None = Field(None, ge=1)
    """Override the model's context length (--context-length)."""
    kv_cache_block_size: int | None = Field(None, ge=1)
    """KV cache block size in tokens (--kv-cache-block-size)."""
    tool_call_parser: ToolCallParser | None = None
    """How frontends find tool calls in the model's output (--dyn-tool-call-parser)."""
    reasoning_parser: ReasoningParser | None = None
    """How frontends split the model's thinking into `reasoning_content` (--dyn-reasoning-parser)."""
    lora_adapters: dict[
        Annotated[str, AfterValidator(_adapter_name)], Annotated[str, AfterValidator(_adapter_path)]
    ] = Field(default_factory=dict)
    """LoRA adapters every worker of the model serves beside it, each as its own model name:
    name -> path (a PEFT folder for vllm, a GGUF LoRA or a folder with one for llamacpp, any path
    for mocker; relative to the graph file) (--lora-modules). More load at run time through the
    frontend's POST /v1/load_lora_adapter."""


# ---------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------


class Restart(_Model):
    """What the supervisor does when a process exits."""

    policy: Literal["never", "on-failure", "always"] = "on-failure"
    """`on-failure` restarts after a non-zero exit or a signal; `always` after any exit."""
    max_restarts: int = Field(5, ge=0)
    """Restarts in a row before the component is reported as crash-looping and left down."""
    backoff_s: float = Field(1.0, ge=0)
    """Delay before the first restart; doubles on each further one."""
    backoff_max_s: float = Field(30.0, ge=0)
    """Ceiling of the doubling delay."""

    @model_validator(mode="after")
    def _ordered(self) -> Restart:
        if self.backoff_max_s < self.backoff_s:
            raise field_error("backoff_max_s", "must be at least `backoff_s`")
        return self


class Readiness(_Model):
    """When a process counts as up: a frontend when its HTTP `/health` answers, a worker when its
    endpoint is registered in discovery. Dependents start after that."""

    timeout_s: float = Field(120.0, gt=0)
    """Give up (and apply the restart policy) if not ready within this many seconds."""


Observability = section("Observability", _Model, TracingSettings)


class Rollout(_Model):
    """How `up` replaces a changed component while it serves: new replicas start beside the old
    ones, and an old one stops (out of routing first, its streams finishing within
    `shutdown_grace_s`) only once its replacement is ready and routable. A replacement that fails
    rolls the whole change back; the previous revision keeps serving. A `canary` also gives the
    new replicas a growing share of the requests and compares how they answer with the old ones
    before it goes on (docs/rollouts.md)."""

    max_surge: int = Field(1, ge=0)
    """New replicas started beside the old ones at a time."""
    max_unavailable: int = Field(0, ge=0)
    """Old replicas stopped before their replacements are ready (capacity given up to roll
    faster, or where a replica's fixed port cannot be shared)."""
    strategy: Literal["rolling", "canary"] = "rolling"
    """`rolling`: batch by batch, each new replica proven ready and routable. `canary` (dynamic
    workers): at each of `steps` the new replicas take that share of the requests for
    `pause_s`, then their error rate and time to first token are compared with the old ones';
    worse than the bounds below rolls back, else the next step (100: the old ones retire)."""
    steps: list[Annotated[int, Field(ge=1, le=100)]] = [10, 50, 100]
    """Canary: percent of the component's requests the new replicas take, step by step
    (ascending, ending at 100)."""
    pause_s: float = Field(30.0, gt=0)
    """Canary: seconds each step serves before it is judged."""
    max_error_rate_increase: float = Field(0.01, ge=0, le=1)
    """Canary: how far the new replicas' error rate (requests they failed, 5xx) may exceed the
    old ones' over a step."""
    max_ttft_p90_ratio: float = Field(1.5, ge=1)
    """Canary: how many times the old replicas' time-to-first-token p90 the new ones' may be."""
    min_requests: int = Field(20, ge=1)
    """Canary: requests each side must answer before a step's time to first token is compared;
    a step waits up to three pauses for them, then is judged on errors alone."""
    checks: bool = False
    """Run the graph's `tests` (those that ask this component's model; default checks without
    `tests`) against the component's first new replicas, through a frontend of their own that
    routes to nothing else, before any old replica retires; a failure rolls back."""

    @model_validator(mode="after")
    def _progresses(self) -> Rollout:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise field_error("max_surge", "cannot be 0 with `max_unavailable` 0: nothing could roll")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise field_error("steps", f"must ascend, not {self.steps}")
        if not self.steps or self.steps[-1] != 100:
            raise field_error("steps", f"must end at 100 (the new revision takes all), not {self.steps}")
        return self


class AutoscaleTarget(_Model):
    """What the planner holds a pool to, over each interval (at least one): latencies, and the
    load thresholds of Dynamo's load mode, read from the workers' load reports."""

    ttft_p90_ms: float | None = Field(None, gt=0)
    """Time to first token, 90th percentile, as the frontends see it (ms)."""
    itl_p90_ms: float | None = Field(None, gt=0)
    """Time between tokens, 90th percentile, as the frontends see it (ms)."""
    kv_usage: float | None = Field(None, gt=0, le=1)
    """KV-cache usage a replica may reach, mean over the pool (0..1: blocks in use / blocks)."""
    waiting_requests: float | None = Field(None, gt=0)
    """Requests waiting to be scheduled a replica may hold, mean over the pool."""
    queued_prefill_tokens: float | None = Field(None, gt=0)
    """Prompt tokens accepted and not yet computed a replica may hold, mean over the pool."""

    @model_validator(mode="after")
    def _some(self) -> AutoscaleTarget:
        if all(getattr(self, key) is None for key in type(self).model_fields):
            keys = ", ".join(f"`{key}`" for key in type(self).model_fields)
            raise field_error("ttft_p90_ms", f"give at least one of {keys}")
        return self


class Autoscale(_Model):
    """Replicas the supervisor's planner sizes from what the frontends measure (docs/autoscaling.md):
    the graph's `replicas` is where it starts."""

    min_replicas: int = Field(1, ge=0)
    """Fewest replicas kept."""
    max_replicas: int = Field(ge=1)
    """Most replicas started (fewer where the hosts' GPUs or `max_gpus` do not allow them)."""
    target: AutoscaleTarget
    """The latency, or the load its workers report, the pool is sized to hold."""
    interval_s: float = Field(5.0, gt=0)
    """How often the planner measures and decides."""
    scale_down_delay_s: float = Field(30.0, ge=0)
    """How long fewer replicas must have been enough before the pool shrinks (no flapping)."""

    @model_validator(mode="after")
    def _ordered(self) -> Autoscale:
        if self.min_replicas > self.max_replicas:
            raise field_error("min_replicas", f"must be at most `max_replicas` ({self.max_replicas})")
        return self


class _Component(_Model):
    env: Env = {}
    """Environment variables of the component's processes."""
    depends_on: list[str] = []
    """Components that must be ready before this one starts."""
    restart: Restart = Restart()
    """Restart policy."""
    readiness: Readiness = Readiness()
    """Readiness probe."""
    shutdown_grace_s: float = Field(10.0, ge=0)
    """Seconds between SIGTERM and SIGKILL on shutdown."""
    rollout: Rollout | None = None
    """How a change replaces the component's replicas; default: the graph's `rollout`."""


_AUTO_PORT = (
    "Or `auto`: one that is free on the frontend's host at `up` (kept for the life of the "
    "supervisor; `up` prints it)."
)


class _HttpTlsBase(_Model):
    ca_file: str | None = None
    """PEM file of the CA that issued `cert_file` (relative to the graph file), for what checks
    the frontend from outside: `render -f prometheus` scrapes its /metrics verifying with it
    (without it, against the trusted CAs of the machine Prometheus runs on). The frontend never
    reads it."""

    @model_validator(mode="after")
    def _ca_of_a_certificate(self) -> _HttpTlsBase:
        if self.ca_file is not None and getattr(self, "cert_file", None) is None:
            raise field_error("ca_file", "is the CA of `cert_file`: give `cert_file` and `key_file` too")
        return self


HttpTls = section("HttpTls", _HttpTlsBase, HttpTlsSettings)


class _HttpBase(_Model):
    tls: HttpTls | None = None  # type: ignore[valid-type]
    """HTTPS: `{cert_file, key_file}`, and `ca_file` for the scraper (paths relative to the graph
    file); without it the port is
    plain HTTP, whatever `security.tls` says (that is between the graph's processes)."""


Http = section("Http", _HttpBase, HttpSettings, overrides={"port": (AutoPort, 8080, _AUTO_PORT)})
Router = section("Router", _Model, RouterConfig)
Disagg = section("Disagg", _Model, DisaggConfig)
Limits = section("Limits", _Model, LimitSettings)
Record = section("Record", _Model, RecordSettings)
Auth = section("Auth", _Model, AuthSettings)


class Frontend(_Component):
    """The OpenAI-compatible HTTP frontend with pre/post-processing and the router
    (`dyngraph run in=http out=auto`)."""

    kind: Literal["frontend"]
    """What the component is: a frontend (the HTTP edge and its routers)."""
    host: str = LOCAL
    """Host the frontend runs on (a key of `hosts`, or `local`)."""
    replicas: int = Field(1, ge=1, le=256)
    """Frontend processes on `host`, sharing the HTTP port (SO_REUSEPORT): `<key>-0` .. `<key>-N-1`
    in `status`, each restarted on its own, each with its own router fed by the same KV events
    and load reports; /metrics answers for all of them (--http-processes for `dyngraph run`; see
    docs/frontend-scaling.md for the default and when to raise it)."""
    http: Http = Http()
    """HTTP listener."""
    router: Router = Router()
    """Routing to worker instances."""
    migration_limit: int | None = Field(None, ge=0)
    """Times a request whose stream breaks is moved to another worker (--migration-limit);
    unset: what the workers' model cards say (their `migration_limit`)."""
    limits: Limits = Limits()
    """Concurrency, time and body-size limits of the HTTP frontend."""
    disagg: Disagg = Disagg()
    """Disaggregated prefill/decode: when prompts stay on the decode worker."""
    record: Record = Record()
    """Recording the requests served as a trace `dyngraph bench --trace` replays (a path is
    relative to the frontend's working directory: the graph's folder, or its host's `workdir`)."""
    api_key_env: list[Annotated[str, AfterValidator(_api_key_env_name)]] = []
    """Names of environment variables holding accepted API keys (never the keys themselves); set
    them in the environment `dyngraph up` runs in. With any, every /v1 route needs
    `Authorization: Bearer KEY`; /health, /live and /metrics stay open."""
    auth: Auth = Auth()
    """API keys with tenants: a keys file (relative to the graph file; on the frontend's host)."""
    models: list[str] | None = None
    """Keys of `models` this frontend serves; default all."""

    @model_validator(mode="after")
    def _no_canary(self) -> Frontend:
        if self.rollout is not None and self.rollout.strategy == "canary":
            raise field_error(
                "rollout.strategy",
                "a frontend's processes share one port, so requests cannot be split between "
                "revisions there; use `rolling` (a canary is for workers)",
            )
        return self


class Gpus(_Model):
    """GPUs each replica uses (--tensor-parallel-size, --base-gpu-id, CUDA_VISIBLE_DEVICES)."""

    per_replica: int = Field(0, ge=0)
    """GPUs one replica uses; 0 for CPU engines."""
    tensor_parallel_size: int = Field(1, ge=1)
    """--tensor-parallel-size."""
    base_gpu_id: int | None = Field(None, ge=0)
    """First GPU on each host; replica k there uses the next `per_replica` from
    `base_gpu_id + k * per_replica`. Default: dyngraph assigns free GPUs."""
    gpu_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Exactly which GPUs the component may use on each host, sliced `per_replica` per
    replica; instead of `base_gpu_id`."""

    @model_validator(mode="after")
    def _consistent(self) -> Gpus:
        if 0 < self.per_replica < self.tensor_parallel_size:
            raise field_error(
                "per_replica",
                f"tensor_parallel_size {self.tensor_parallel_size} needs at least that many GPUs per replica",
            )
        if self.gpu_ids is not None and self.base_gpu_id is not None:
            raise field_error("gpu_ids", "give either `gpu_ids` or `base_gpu_id`, not both")
        if (self.gpu_ids is not None or self.base_gpu_id is not None) and self.per_replica == 0:
            raise field_error("per_replica", "GPU ids are given but `per_replica` is 0")
        if self.gpu_ids is not None and len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise field_error("gpu_ids", "lists a GPU more than once")
        return self


class Worker(_Component):
    """Replicas of an engine serving one model on one endpoint (`dyngraph run in=dyn://...`)."""

    kind: Literal["worker"]
    """What the component is: a worker (an engine serving a model)."""
    model: str
    """Key of the model in `models`."""
    engine: str
    """echo_core, echo_full, mocker, vllm, llamacpp, mistralrs, sglang, trtllm, or a Python engine
    file, relative to the graph file: `FILE.py` (an LLMEngine class), `pystr:FILE.py` or
    `pytok:FILE.py` (dynamo-run's `async def generate`)."""
    endpoint: str | None = None
    """`component[.endpoint]` in the graph's namespace, or `dyn://namespace.component.endpoint`;
    default `<namespace>.<component key>.generate`."""
    engine_args: dict[str, Any] | None = None
    """Engine arguments inline (written to a JSON file for --extra-engine-args)."""
    engine_args_file: str | None = None
    """JSON file of engine arguments (--extra-engine-args); instead of `engine_args`."""
    replicas: int = Field(1, ge=0)
    """Copies of the engine; replica i runs on `placement[i % len(placement)]` (over several
    hosts: `nodes`). 0 keeps the component declared with nothing running (e.g. a prefill pool
    scaled down by a re-`up`). With `autoscale`, where the planner starts."""
    autoscale: Autoscale | None = None
    """Let the supervisor's planner size the replicas between `min_replicas` and `max_replicas`."""
    placement: list[str] = Field([LOCAL], min_length=1)
    """Hosts the replicas are spread over, round-robin (keys of `hosts`, or `local`)."""
    nodes: int = Field(1, ge=1, le=64)
    """Hosts one replica spans, for a model bigger than one node: its ranks run on `nodes`
    distinct hosts of `placement`, rank r of replica i on `placement[(i * nodes + r) %
    len(placement)]` (a placement of one host runs them all there: a rehearsal on one
    machine). Rank 0, the leader, serves the endpoint; the others join it at the rendezvous
    port it listens on (--num-nodes, --node-rank, --leader-addr). The ranks of a replica
    start, stop, restart and roll out together. `gpus.per_replica` is the whole replica's, split
    evenly: `per_replica / nodes` on each host; `tensor_parallel_size` × the engine's pipeline
    and data parallel sizes (engine_args) is the engine's ranks, a multiple of `nodes` and, with
    GPUs, `per_replica`. Engines vllm, sglang, trtllm and python files. A trtllm replica is
    instead one MPI world (`trtllm-llmapi-launch`), which only the Slurm target starts (one
    `srun --mpi=pmix` step over its nodes)."""
    gpus: Gpus = Gpus()
    """GPU use per replica."""
    role: Literal["agg", "prefill", "decode"] = "agg"
    """`agg` does whole requests; a model with `prefill` workers needs `decode` ones and back."""
    embedding: bool = False
    """Serve the model's embeddings (`/v1/embeddings`) instead of generating (--embedding):
    engines mocker, llamacpp (set `pooling` in engine_args for a model without one), vllm."""
    static: bool = False
    """Serve without discovery on fixed ports (--static-worker); needs `tcp_port` and the tcp
    request plane."""
    tcp_port: Port | None = None
    """Request-plane port of replica 0 (DYN_TCP_PORT); replica i uses `tcp_port + i`.
    Default: a free port."""
    metrics_port: AutoPort | None = "auto"
    """Port of replica 0's `/metrics`: its requests and its engine's own series (vLLM's
    `vllm:`, the mocker's, llama.cpp's), scraped by `render -f prometheus` (--metrics-port);
    replica i uses `metrics_port + i`; `auto`: a free port each; null: none. With TLS on
    (`security.tls`) it is HTTPS wanting a client certificate of the graph's CA (Prometheus gets
    one: `render -f prometheus`)."""
    migration_limit: int = Field(0, ge=0)
    """Migration limit advertised in the model card (--migration-limit)."""
    max_inflight: int | None = Field(None, ge=0)
    """Requests one replica takes at once; more are answered `overloaded` and go to another
    replica (--max-inflight; default 1024, 0 = unlimited)."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        if engine in ENGINES or registry.engine_file(engine) is not None:
            return engine
        raise ValueError(
            f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)} or a Python file "
            "(FILE.py, pystr:FILE.py, pytok:FILE.py)"
        )

    @field_validator("endpoint")
    @classmethod
    def _endpoint_syntax(cls, endpoint: str | None) -> str | None:
        if endpoint is not None:
            resolve_endpoint(endpoint, namespace="ns", component="comp")
        return endpoint

    @model_validator(mode="after")
    def _autoscaled(self) -> Worker:
        scale = self.autoscale
        if scale is None:
            return self
        if not scale.min_replicas <= self.replicas <= scale.max_replicas:
            raise field_error(
                "replicas",
                f"must be within autoscale's {scale.min_replicas}..{scale.max_replicas} (where it starts)",
            )
        if self.static:
            raise field_error("autoscale", "a static worker is found at fixed addresses: it cannot scale")
        return self

    @model_validator(mode="after")
    def _canary_splits_traffic(self) -> Worker:
        if self.rollout is not None and self.rollout.strategy == "canary" and self.static:
            raise field_error(
                "rollout.strategy",
                "a static worker cannot run beside its replacement on its fixed port: no canary",
            )
        return self

    @model_validator(mode="after")
    def _one_engine_args(self) -> Worker:
        if self.engine_args is not None and self.engine_args_file is not None:
            raise field_error("engine_args_file", "give either `engine_args` or `engine_args_file`, not both")
        return self

    @model_validator(mode="after")
    def _embedding_worker(self) -> Worker:
        if not self.embedding:
            return self
        if self.engine not in registry.EMBEDDING_ENGINES:
            raise field_error(
                "embedding",
                f"engine {self.engine} has no embedding mode ({', '.join(registry.EMBEDDING_ENGINES)} have)",
            )
        if self.role != "agg":
            raise field_error(
                "embedding", f"an embedding worker has no prefill/decode split; not role {self.role}"
            )
        return self

    @model_validator(mode="after")
    def _multi_node(self) -> Worker:
        """A replica over `nodes` hosts: distinct hosts, and its GPUs and model ranks split evenly."""
        if self.nodes == 1:
            return self
        if self.engine not in registry.MULTI_NODE_ENGINES and not self.engine.endswith(".py"):
            spans = ", ".join(sorted(registry.MULTI_NODE_ENGINES))
            raise field_error(
                "nodes", f"engine {self.engine} runs on one node; {spans} and python files span nodes"
            )
        one_host = len(self.placement) == 1
        if not one_host and (
            len(set(self.placement)) != len(self.placement) or len(self.placement) < self.nodes
        ):
            raise field_error(
                "placement",
                f"`nodes: {self.nodes}` puts each replica's ranks on {self.nodes} distinct hosts: "
                f"list at least {self.nodes} hosts, none twice (or one, to run them all there)",
            )
        per, ranks = self.gpus.per_replica, self.model_ranks()
        if per % self.nodes:
            raise field_error("gpus.per_replica", f"{per} GPUs do not split evenly over {self.nodes} nodes")
        if ranks % self.nodes:
            raise field_error(
                "gpus.tensor_parallel_size",
                f"tensor × pipeline × data parallel size {ranks} is not a multiple of `nodes` "
                f"({self.nodes}): each node runs an equal share of the engine's ranks",
            )
        if per and ranks != per:
            raise field_error(
                "gpus.per_replica",
                f"a replica over {self.nodes} nodes runs one rank per GPU: tensor × pipeline × data "
                f"parallel size is {ranks}, per_replica {per}",
            )
        return self

    def model_ranks(self) -> int:
        """tensor_parallel_size × the pipeline and data parallel sizes in `engine_args` (vLLM's
        and TensorRT-LLM's `pipeline_parallel_size` and `data_parallel_size`, SGLang's `pp_size`
        and `dp_size`): the ranks (GPUs) one replica's engine runs."""
        args = self.engine_args or {}
        pipeline = args.get("pipeline_parallel_size") or args.get("pp_size") or 1
        data = args.get("data_parallel_size") or args.get("dp_size") or 1
        return self.gpus.tensor_parallel_size * int(pipeline) * int(data)

    @property
    def gpus_per_node(self) -> int:
        """GPUs each process of a replica uses on its host."""
        return self.gpus.per_replica // self.nodes

    def endpoint_name(self) -> EndpointName:
        """The endpoint; complete once `Graph` has validated (it fills in the default)."""
        assert self.endpoint is not None, "Graph validation fills in the endpoint"
        return EndpointName.parse(self.endpoint)

    def hosts_of_replica(self, replica: int) -> list[str]:
        """Hosts of one replica's ranks, leader first (one host unless `nodes` > 1)."""
        return [self.placement[(replica * self.nodes + r) % len(self.placement)] for r in range(self.nodes)]

    def hosts_of_replicas(self) -> list[str]:
        """Host of each process, replica by replica (a multi-node replica's in rank order)."""
        return [host for replica in range(self.replicas) for host in self.hosts_of_replica(replica)]


def resolve_endpoint(text: str | None, *, namespace: str, component: str) -> EndpointName:
    """`dyn://ns.comp.ep` as dynamo-run reads it, `comp[.ep]` inside `namespace`, or the default
    `namespace.component.generate`. Raises ValueError on a malformed name."""
    if text is None:
        return EndpointName(namespace, component, DEFAULT_ENDPOINT)
    if text.startswith("dyn://"):
        return EndpointName.parse(text)
    parts = text.split(".")
    if len(parts) > 2:
        raise ValueError(f"{text!r}: write `dyn://{text}` for an endpoint with a namespace, else comp.ep")
    return EndpointName.parse(f"dyn://{namespace}.{text}")


Component = Annotated[Frontend | Worker, Field(discriminator="kind")]


# ---------------------------------------------------------------------------------------------
# Kubernetes targets (`render -f k8s`, `render -f dynamo-k8s`)
# ---------------------------------------------------------------------------------------------

# Kubernetes object names (RFC 1123 labels): lower-case letters, digits and '-'.
_K8S_NAME_RE = r"^[a-z0-9]([a-z0-9\-]{0,61}[a-z0-9])?$"
K8sName = Annotated[str, Field(pattern=_K8S_NAME_RE)]


class ModelVolume(_Model):
    """Where pods find models given by a local path: the folder `models.X.path` names must sit
    under `mount_path` by its own folder name (`../.cache/tiny-model` -> `/models/tiny-model`).
    Hub ids (`org/name`) download into `mount_path/huggingface` (HF_HOME), so they survive restarts."""

    claim: K8sName | None = None
    """An existing PersistentVolumeClaim to mount; default: render one named `<graph>-models`."""
    host_path: str | None = None
    """A folder on every node to mount instead of a claim (single-node or pre-seeded clusters)."""
    size: str = Field("50Gi", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$")
    """Size of the rendered claim (ReadWriteMany, so replicas on different nodes share it)."""
    storage_class: str | None = None
    """Storage class of the rendered claim; default the cluster's. Dynamo's operator creates a
    claim only with one (without, `render -f dynamo-k8s` expects the claim to exist)."""
    mount_path: str = Field("/models", pattern=r"^/")
    """Where the volume appears in every worker container."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelVolume:
        if self.claim is not None and self.host_path is not None:
            raise field_error("host_path", "give either `claim` or `host_path`, not both")
        return self


class Kubernetes(_Model):
    """How the graph is dressed for a cluster: images, where in it, pull secrets, models' storage.
    Only the Kubernetes renderers read this section; `dyngraph up` ignores it."""

    image: str = "dyngraph:0.1.0"
    """Image with dyngraph (and the engines the workers use) installed, for `render -f k8s`."""
    dynamo_image: str | None = None
    """Image of Dynamo's runtime for `render -f dynamo-k8s`; default
    `nvcr.io/nvidia/ai-dynamo/<backend>-runtime:1.6.1` (vllm's for the mocker and the frontend)."""
    namespace: K8sName | None = None
    """Kubernetes namespace of every object; default none (the one `kubectl -n` picks)."""
    image_pull_secrets: list[K8sName] = []
    """Secrets with registry credentials (imagePullSecrets)."""
    service_account: K8sName | None = None
    """Service account of every pod; default the namespace's default."""
    secret: K8sName | None = None
    """Secret that holds the values of secret environment variables (API keys, tokens, URLs with
    credentials), one key per variable name; default `<graph>-secrets`. Never rendered: create it
    with `kubectl create secret generic`."""
    working_dir: str | None = None
    """Working directory of Dynamo's worker containers (`render -f dynamo-k8s`), where relative
    paths in their engine args start, e.g. `/workspace/components/backends/vllm`."""
    env_from_secret: K8sName | None = None
    """Secret whose keys all become workers' environment (DGD `envFromSecret`, e.g. a
    `hf-token-secret` holding HF_TOKEN)."""
    models: ModelVolume = ModelVolume()
    """Storage that holds the models."""


# ---------------------------------------------------------------------------------------------
# Slurm target (`up --target slurm`, `render -f slurm`)
# ---------------------------------------------------------------------------------------------

# sbatch's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
_SLURM_TIME_RE = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
_GRES_RE = re.compile(r"^[A-Za-z0-9_\-]+(:[A-Za-z0-9_\-.]+)?$")
SBATCH_MANAGED = (
    "--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--gres", "--gpus", "-G",
    "--gpus-per-node", "--gpus-per-task", "--output", "-o", "--error", "-e", "--job-name", "-J",
    "--partition", "-p", "--account", "-A", "--time", "-t", "--qos", "-q", "--chdir", "-D",
)  # fmt: skip
"""sbatch options the Slurm target sets from the graph: `slurm.sbatch` may not repeat them."""


def _slurm_time(value: str) -> str:
    if not _SLURM_TIME_RE.match(value):
        raise ValueError(f"{value!r} is not a Slurm time limit: MM, HH:MM:SS, D-HH:MM or UNLIMITED")
    return value


def _gres(value: str) -> str:
    if not _GRES_RE.match(value):
        raise ValueError(f"{value!r} is not a GRES name: `gpu`, or with a type, `gpu:a100`")
    return value


def _sbatch_option(option: str) -> str:
    if not option.startswith("-") or any(c in option for c in "\n\r"):
        raise ValueError(f"{option!r} is not an sbatch option (e.g. `--constraint=h100`)")
    name = option.split("=", 1)[0]
    if name in SBATCH_MANAGED:
        raise ValueError(
            f"{name} is set by dyngraph from the graph (replicas, GPUs, placement, `slurm.*` keys); "
            "remove it here"
        )
    return option


class Slurm(_Model):
    """The Slurm job `up --target slurm` submits (and `render -f slurm` prints): one allocation
    with a node per host key the components use (`local` first), each process an `srun` step.
    Hosts other than `local` then need no `ssh`: they are nodes of the allocation."""

    partition: str | None = None
    """Partition to run in (`--partition`); default the cluster's."""
    account: str | None = None
    """Account charged (`--account`)."""
    qos: str | None = None
    """Quality of service (`--qos`)."""
    time: Annotated[str, AfterValidator(_slurm_time)] | None = None
    """Time limit (`--time`): `MM`, `HH:MM:SS`, `D-HH:MM`, ... or `UNLIMITED`; default the
    partition's."""
    job_name: Name | None = None
    """Job name (`--job-name`); default the graph's name."""
    gres: Annotated[str, AfterValidator(_gres)] = "gpu"
    """GRES of the GPUs, `name` or `name:type` (`--gres=<gres>:N` per node and per step)."""
    sbatch: list[Annotated[str, AfterValidator(_sbatch_option)]] = []
    """Further sbatch options, one per item: `--constraint=h100`, `--exclusive`, `--mem=0`."""


# ---------------------------------------------------------------------------------------------
# Smoke checks (`dyngraph test`)
# ---------------------------------------------------------------------------------------------


class TokenCount(_Model):
    """A range of token counts; either bound may be left out."""

    min: int | None = Field(None, ge=0)
    """The fewest tokens allowed."""
    max: int | None = Field(None, ge=0)
    """The most tokens allowed."""

    @model_validator(mode="after")
    def _ordered(self) -> TokenCount:
        if self.min is not None and self.max is not None and self.max < self.min:
            raise field_error("max", "must be at least `min`")
        return self


def _exact_count(value: Any) -> Any:
    return {"min": value, "max": value} if isinstance(value, int) and not isinstance(value, bool) else value


Tokens = Annotated[TokenCount, BeforeValidator(_exact_count, json_schema_input_type=int | TokenCount)]
"""A token count: a number, or `{min: .., max: ..}`."""


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class Expect(_Model):
    """What a request's answer must be; every given expectation is checked."""

    status: int = Field(200, ge=100, le=599)
    """HTTP status of the response."""
    contains: Annotated[list[str], BeforeValidator(_as_list)] = []
    """Strings the answer's text must contain (for an error status: the error message)."""
    regex: str | None = None
    """A regular expression the text must match somewhere (Python `re.search`)."""
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None = None
    """The choice's finish reason."""
    prompt_tokens: Tokens | None = None
    """`usage.prompt_tokens`: a number, or `{min: .., max: ..}`."""
    completion_tokens: Tokens | None = None
    """`usage.completion_tokens`: a number, or `{min: .., max: ..}`."""
    tool_calls: list[str] | None = None
    """Names of the functions the answer calls, in order (chat only)."""
    ttft_s: float | None = Field(None, gt=0)
    """Budget for the time to the first token, in seconds (streamed requests only)."""
    latency_s: float | None = Field(None, gt=0)
    """Budget for the whole request, in seconds."""

    @field_validator("regex")
    @classmethod
    def _compiles(cls, regex: str | None) -> str | None:
        if regex is not None:
            try:
                re.compile(regex)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
        return regex


class _SmokeRequest(_Model):
    model: str | None = None
    """Model name to ask for; default the first model the check's frontend serves."""
    max_tokens: int = Field(16, ge=1)
    """max_tokens of the request."""
    stream: bool = False
    """Stream the answer (server-sent events; usage comes in the last chunk)."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature of the request; default the server's."""
    seed: int | None = None
    """Sampling seed of the request."""
    stop: Annotated[list[str], BeforeValidator(_as_list)] | None = None
    """Stop strings of the request (one string or a list)."""
    extra: dict[str, Any] = {}
    """Any other fields of the OpenAI request, sent as given."""


class SmokeChat(_SmokeRequest):
    """A `/v1/chat/completions` request: `messages`, or `prompt` as one user message."""

    messages: list[dict[str, Any]] | None = None
    """The chat messages, as OpenAI takes them."""
    prompt: str | None = None
    """One user message (instead of `messages`)."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI tool definitions (`{type: function, function: {name, parameters}}`)."""
    tool_choice: str | dict[str, Any] | None = None
    """OpenAI's `tool_choice`: `auto`, `none`, `required` or a named function."""

    @model_validator(mode="after")
    def _one_input(self) -> SmokeChat:
        if (self.messages is None) == (self.prompt is None):
            raise field_error("prompt", "give either `messages` or `prompt`")
        return self


class SmokeCompletion(_SmokeRequest):
    """A `/v1/completions` request."""

    prompt: str
    """The prompt text."""


class SmokeFault(_Model):
    """Kill one replica of a component; the supervisor restarts it as its policy says."""

    kill: Name
    """Key of the component (a worker, or the frontend) whose replica is killed."""
    replica: int = Field(0, ge=0)
    """Which replica."""
    signal: Literal["SIGKILL", "SIGTERM", "SIGINT"] = "SIGKILL"
    """The signal sent to the replica's process group."""
    wait_ready: bool = False
    """Wait until the supervisor has the replica ready again before the next check."""


_CHECK_KINDS = ("chat", "completion", "models", "metrics", "fault")


class SmokeCheck(_Model):
    """One step of `tests`, run in order: exactly one of `chat`, `completion`, `models`,
    `metrics` or `fault`."""

    name: str | None = None
    """Name in the summary and the JUnit report; default the step's kind and index."""
    frontend: Name | None = None
    """Key of the frontend the step talks to; default the graph's first frontend."""
    chat: SmokeChat | None = None
    """A chat completions request to send."""
    completion: SmokeCompletion | None = None
    """A completions request to send."""
    models: list[str] | None = Field(None, min_length=1)
    """Model names `/v1/models` must list."""
    metrics: Annotated[list[str], BeforeValidator(_as_list)] | None = Field(None, min_length=1)
    """Expressions on the frontend's `/metrics`, all of which must hold:
    `NAME{label="value",...} OP NUMBER`, the sum of the matching samples (OP: == != >= <= > <)."""
    fault: SmokeFault | None = None
    """A replica to kill."""
    expect: Expect | None = None
    """Expectations of a `chat` or `completion` answer; default: status 200."""
    repeat: int = Field(1, ge=1, le=1000)
    """Send the request this many times, one after another; each answer must pass."""
    timeout_s: float = Field(60.0, gt=0)
    """Give up on one request (or on `metrics` holding) after this many seconds."""

    @field_validator("metrics")
    @classmethod
    def _expressions(cls, exprs: list[str] | None) -> list[str] | None:
        for expr in exprs or []:
            parse_metric_expr(expr)
        return exprs

    @model_validator(mode="after")
    def _one_kind(self) -> SmokeCheck:
        given = [k for k in _CHECK_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise field_error(
                given[1] if len(given) > 1 else "chat",
                f"give exactly one of {', '.join(_CHECK_KINDS)}"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        request = self.chat or self.completion
        if self.expect is not None and request is None:
            raise field_error("expect", "only a `chat` or `completion` check has `expect`")
        if request is not None and self.expect is not None:
            if self.expect.ttft_s is not None and not request.stream:
                raise field_error("expect.ttft_s", "a time to first token needs `stream: true`")
            if self.expect.tool_calls is not None and self.completion is not None:
                raise field_error("expect.tool_calls", "tool calls are a chat answer's")
        if self.repeat > 1 and request is None:
            raise field_error("repeat", "only a `chat` or `completion` check repeats")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in _CHECK_KINDS if getattr(self, k) is not None)


def _yaml_off(value: Any) -> Any:
    return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false


class Security(_Model):
    """How the graph's processes talk to each other (docs/security.md)."""

    tls: Annotated[Literal["auto", "required", "off"], BeforeValidator(_yaml_off)] = "auto"
    """Mutual TLS between the graph's processes, with a CA and certificates that `up` makes in the
    state dir: the tcp request plane and its streams, managed etcd and nats-server and their
    clients; the zmq event plane speaks CURVE. `auto`: on when components run on more than one
    host; `required`: on everywhere, and a listener that cannot be encrypted (vLLM's NIXL side
    channel) is an error; `off`: plain TCP (`up` warns about it for a graph on several hosts)."""


# ---------------------------------------------------------------------------------------------
# The graph
# ---------------------------------------------------------------------------------------------


class SupervisorEndpoint(_Model):
    """The supervisor's own endpoint (docs/observability.md)."""

    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the supervisor's `/metrics`: replicas by state, restarts, revisions and the
    autoscaler's decisions; none: not served. HTTPS with a client certificate with TLS on, as
    the workers'."""
    metrics_host: str = "127.0.0.1"
    """Address it listens on (the machine `up` runs on)."""


class Graph(_Model):
    """A deployment: models, the components that serve them, the hosts they run on and the
    runtime planes between them. Relative paths are relative to the graph file's directory."""

    name: Name
    """The graph's name (processes, logs and the status table use it); state lives in
    `.dyngraph/<graph file stem>/` next to the graph file."""
    namespace: Name | None = None
    """Dynamo namespace of the components' endpoints; default `name`."""
    runtime: RuntimePlanes = RuntimePlanes()
    """Discovery, request plane and event plane."""
    infra: Infra = Infra()
    """etcd and nats-server, managed by dyngraph or external."""
    security: Security = Security()
    """Encryption and authentication between the graph's processes."""
    hosts: dict[Name, Host] = {}
    """Machines by name; `local` exists without being declared (declare it to set its `gpus`)."""
    models: dict[Name, Model] = {}
    """Models by key."""
    components: dict[Name, Component] = {}
    """Frontends and workers by name (`kind: frontend` or `kind: worker`)."""
    kubernetes: Kubernetes = Kubernetes()
    """Images, namespace, secrets and model storage for the Kubernetes renderers."""
    slurm: Slurm | None = None
    """The Slurm job of `up --target slurm`; with it, hosts are nodes of the allocation."""
    observability: Observability = Observability()
    """Tracing: where every process sends its spans, and how many requests are traced."""
    rollout: Rollout = Rollout()
    """How a change replaces a component's replicas, for components without their own `rollout`."""
    max_gpus: int | None = Field(None, ge=0)
    """GPUs the graph may use at most, all its replicas together: autoscaled pools stop short of it."""
    supervisor: SupervisorEndpoint = SupervisorEndpoint()
    """The supervisor's own metrics endpoint."""
    tests: list[SmokeCheck] | None = None
    """Smoke checks `dyngraph test` runs once the graph is up, in order; default: the models are
    listed, and one chat, one streamed chat and one completion request succeed."""

    @model_validator(mode="after")
    def _ssh_only_remote(self) -> Graph:
        for key, host in self.hosts.items():
            if key == LOCAL and host.ssh is not None:
                raise field_error(f"hosts.{key}.ssh", "`local` is this machine: it takes no `ssh` block")
            if key != LOCAL and host.ssh is None and self.slurm is None:
                raise field_error(
                    f"hosts.{key}.ssh",
                    "a host other than `local` needs `ssh: {address: ...}` (or a `slurm:` section, "
                    "where hosts are nodes of the job)",
                )
        return self

    @model_validator(mode="after")
    def _fill_defaults(self) -> Graph:
        """Spell out defaults that depend on other keys, so the validated graph (which `render`
        prints and `compile` reads) is explicit."""
        if self.namespace is None:
            self.namespace = self.name
        for key, model in self.models.items():
            if model.name is None:
                model.name = key
        for key, comp in self.components.items():
            if isinstance(comp, Worker):
                comp.endpoint = str(resolve_endpoint(comp.endpoint, namespace=self.namespace, component=key))
        return self

    def host(self, key: str) -> Host:
        """A host by key; an undeclared `local` is a default one."""
        return self.hosts[key] if key in self.hosts else Host()

    def workers(self) -> dict[str, Worker]:
        return {k: c for k, c in self.components.items() if isinstance(c, Worker)}

    def frontends(self) -> dict[str, Frontend]:
        return {k: c for k, c in self.components.items() if isinstance(c, Frontend)}

    def slurm_nodes(self) -> list[str]:
        """Host keys in the order of a Slurm job's nodes: each key the components use is a node,
        `local` (where managed etcd / nats run) first, the others sorted. An autoscaled worker's
        whole placement: its standby replicas are steps of the job too."""
        workers = self.workers().values()
        used = {h for w in workers for h in (w.placement if w.autoscale else w.hosts_of_replicas())}
        used |= {f.host for f in self.frontends().values()}
        etcd, nats = self.infra.etcd, self.infra.nats
        if (etcd is not None and etcd.managed) or (nats is not None and nats.managed) or not used:
            used.add(LOCAL)
        return sorted(used, key=lambda h: (h != LOCAL, h))


def export_json_schema() -> dict[str, Any]:
    """The JSON Schema of a graph file, for editors (yaml-language-server) and CI."""
    schema = Graph.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "dyngraph graph"
    return schema


def dump_json_schema() -> str:
    """Deterministic text of the schema: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(export_json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(dump_json_schema())
