"""The launch plan: what `dyngraph up` runs and `dyngraph render` prints.

Plain msgspec structs with no pydantic or graph-schema imports, so the supervisor (which reads
a plan from its state dir) starts fast. `compile.py` builds them from a validated graph.
Port names in `ProcessSpec.ports` are the same names as the `{port:NAME}` placeholders.
"""

from __future__ import annotations

from typing import Literal

import msgspec

LOCAL = "local"
"""The host dyngraph runs on; every other host of a plan is reached over ssh (`Plan.hosts`)."""


class Probe(msgspec.Struct, frozen=True):
    """How the supervisor knows a process is ready: an HTTP 200, a TCP connect, or a log line."""

    kind: Literal["http", "tcp", "log"]
    target: str
    timeout_s: float


class RestartPolicy(msgspec.Struct, frozen=True):
    policy: Literal["never", "on-failure", "always"]
    max_restarts: int
    backoff_s: float
    backoff_max_s: float


class RolloutPolicy(msgspec.Struct, frozen=True):
    """How a changed component's replicas are replaced (see targets/local/rollout.py and
    canary.py): the graph's `rollout` section, field for field (schema.py documents them)."""

    max_surge: int = 1
    max_unavailable: int = 0
    strategy: Literal["rolling", "canary"] = "rolling"
    steps: tuple[int, ...] = (10, 50, 100)
    pause_s: float = 30.0
    max_error_rate_increase: float = 0.01
    max_ttft_p90_ratio: float = 1.5
    min_requests: int = 20
    checks: bool = False


class AutoscalePolicy(msgspec.Struct, frozen=True):
    """A pool the supervisor's planner sizes (targets/local/planner.py): the graph's `autoscale`,
    with `max_replicas` cut to what the hosts' GPUs and `max_gpus` allow (`capped` says why)."""

    min_replicas: int
    max_replicas: int
    wanted_max: int  # the graph's max_replicas
    capped: str  # why max_replicas < wanted_max; "" when it is not
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    interval_s: float
    scale_down_delay_s: float
    role: str = "agg"  # the worker's: a prefill pool is sized by prompt tokens, decode by output
    kv_usage: float | None = None  # the load thresholds (the workers' load reports), per replica
    waiting_requests: float | None = None
    queued_prefill_tokens: float | None = None


class TlsPlan(msgspec.Struct, frozen=True):
    """`security.tls` on: the folder of the graph's CA and certificates (graph/tls.py), and the
    names each process's certificate is valid for (its host's address), by process."""

    dir: str
    names: dict[str, list[str]]


class ProcessSpec(msgspec.Struct, frozen=True):
    name: str  # unique in the plan: "<component>-<replica>", "etcd", "nats"
    component: str
    replica: int
    host: str
    argv: list[str]
    env: dict[str, str]
    workdir: str
    ports: dict[str, int | str]  # port name -> fixed port or "auto"
    depends_on: list[str]  # names of processes that must be ready first
    readiness: Probe
    restart: RestartPolicy
    shutdown_grace_s: float
    role: str = "agg"
    rollout: RolloutPolicy = RolloutPolicy()
    # Whether a new run may start beside the old one (a frontend shares its port, a dynamic
    # worker registers beside it); False: the old run stops first (etcd, nats, a static worker).
    rolls: bool = False
    # Whether the new run binds the old one's ports too (SO_REUSEPORT: a frontend); False: a
    # rolling process's `auto` ports are fresh for the new run.
    shares_ports: bool = False
    # A prefill or decode worker's "MODEL@hash" of what its model's prefill and decode workers
    # must share for KV to move between them (model files, block size, engine, connector); "".
    pairing: str = ""
    # Variables of `env` that name a file the process needs where it runs (its TLS key and
    # certificates): on a remote host the ssh launcher carries the file's contents over the
    # channel, and the agent points the variable at its private copy there.
    carry: list[str] = []
    # A replica over several nodes (a worker's `nodes`): its leader's name, the same for all its
    # ranks, which start, stop and restart together (targets/local/gang.py); "" for a replica
    # of one process.
    group: str = ""
    rank: int = 0  # this process's node rank in its group; 0 is the leader, which serves
    # A TensorRT-LLM replica over several nodes is one MPI world, not ranks joined at a leader's
    # address: this process is its launch (`trtllm-llmapi-launch dyngraph run ...` in every task;
    # task 0 serves, the others are TensorRT-LLM's MPI workers), `mpi_tasks` tasks on each of
    # these hosts, `host` first. Slurm starts it as one `srun --mpi=pmix` step; [] otherwise.
    mpi_hosts: list[str] = []
    mpi_tasks: int = 0


class RemoteHost(msgspec.Struct, frozen=True):
    """How the supervisor reaches a remote host and runs dyngraph there (from `hosts.<key>`)."""

    address: str
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None  # a known_hosts file; None: the ssh client's default ones
    host_key: str | None = None  # a pinned public key ("ssh-ed25519 AAAA..."), instead of known_hosts
    python: str = "python3"  # the interpreter with dyngraph installed (a venv's bin/python)


class Plan(msgspec.Struct, frozen=True):
    graph: str
    namespace: str
    graph_file: str
    state_dir: str
    files: dict[str, str]  # files the supervisor writes before launch (engine args), path -> text
    processes: list[ProcessSpec]
    hosts: dict[str, RemoteHost] = {}  # remote hosts the processes run on, by key; `local` is never here
    # The interpreter that runs local processes' `dyngraph` (hosts.local.python / venv); None: the
    # supervisor's own.
    local_python: str | None = None
    # The validated graph as JSON, for a rollout's `checks` (`dyngraph test --against` reads it);
    # empty unless a component's rollout has them.
    graph_json: str = ""
    # Autoscaled components (by name), and their replicas beyond the graph's `replicas`, up to
    # the most that fit: the supervisor starts them as its planner asks (`processes` has the rest).
    autoscale: dict[str, AutoscalePolicy] = {}
    standby: list[ProcessSpec] = []
    # Where the supervisor serves its own /metrics (host, port); None: nowhere.
    supervisor_metrics: tuple[str, int] | None = None
    tls: TlsPlan | None = None  # None: the graph's processes talk plain TCP


def port_placeholder(name: str) -> str:
    return "{port:" + name + "}"
