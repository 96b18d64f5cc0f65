"""Graph -> Plan: one process spec per replica, each a `dyngraph run ...` command line (or an
etcd / nats-server the graph asks dyngraph to manage).

The plan is what `dyngraph up` launches and what `dyngraph render` prints, so it is a pure
function of the validated graph and where its file lives: same input, same plan, byte for
byte. Ports the graph leaves as `auto` appear as `{port:NAME}` placeholders that the
supervisor fills with ports free on the host of the process that declares them, at launch (a
remote host is asked over ssh); the argv's leading `dyngraph` is the console
script (a launcher may run it as `python -m dynamo_graph`).

Processes on remote hosts get their host's `env`, its advertise address (DYN_TCP_HOST /
DYN_TCP_ADVERTISE_HOST) and, for managed etcd / nats, URLs at the address the local host
advertises; the plan's `hosts` tells the ssh launcher how to reach each remote host. GPUs are
given out per host: explicit ids as written, the rest in graph order from the lowest GPU no
component named, so two components on one host never share a GPU (validate.py checks counts).
Ports that engines open beside our planes (vLLM's NIXL side channel) are `auto` ports of their
process too, so two replicas on one host never share one, and so is each worker's `/metrics`
(`metrics_port`, on by default as Dynamo's system port is; HTTPS with a client certificate when
TLS is on), bound on its host's address.

With `security.tls` on (`required`, or `auto` on several hosts), each process is given the paths
of the graph's CA and of its own certificate and key (graph/tls.py makes them at `up`; `Plan.tls`
says which names each certificate holds), for the tcp request plane and /metrics (DYN_TLS_*) and
managed etcd (ETCD_AUTH_*) and nats-server (NATS_TLS_*), which then serve TLS only and require a
client certificate, and the graph's CURVE key for the zmq event plane (DYN_ZMQ_CURVE_KEY_FILE);
the supervisor (for its /metrics) and Prometheus (the scraper, under a CA of its own that only
/metrics listeners trust: DYN_TLS_METRICS_CA_FILE) get certificates too. Paths
only: no key material is in the plan, so `render` and `status` show none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import msgspec
import yaml

from dynamo_graph.backend.settings import FOLLOWING, EngineSettings, WorkerSettings
from dynamo_graph.engines.registry import engine_file
from dynamo_graph.frontend.settings import (
    GROUP_ENV,
    AuthSettings,
    HttpTlsSettings,
    LimitSettings,
    RecordSettings,
)
from dynamo_graph.graph.plan import (
    AutoscalePolicy,
    Plan,
    Probe,
    ProcessSpec,
    RemoteHost,
    RestartPolicy,
    RolloutPolicy,
    TlsPlan,
    port_placeholder,
)
from dynamo_graph.graph.schema import LOCAL, Frontend, Graph, Worker
from dynamo_graph.graph.tls import (
    METRICS_NAME,
    SCRAPE_CA,
    SCRAPER,
    SUPERVISOR,
    ca_file,
    cert_files,
    curve_file,
    tls_dir,
)
from dynamo_graph.options import to_argv
from dynamo_graph.router.config import DisaggConfig, RouterConfig
from dynamo_graph.runtime.settings import TracingSettings
from dynamo_graph.runtime.tls import ENV_CA, ENV_CERT, ENV_KEY, ENV_METRICS_CA

REMOTE_HOME = "~"  # the workdir of a remote process when its host sets none: the ssh user's home

PYTHON_HASH_SEED = "0"  # engines' block hashes must agree across processes (docs/kv-events.md)
# Engine arguments that shape a KV cache or move it (vLLM's, SGLang's, the mocker's names): a
# prefill worker's KV is of use to a decode worker only where these agree.
KV_SHAPING_ENGINE_ARGS = frozenset(
    {
        "block_size",
        "dtype",
        "kv_cache_dtype",
        "kv_transfer_config",
        "quantization",
        "revision",
        "disaggregation_transfer_backend",
        "page_size",
    }
)


def _port(value: int | str, name: str) -> str:
    return port_placeholder(name) if value == "auto" else str(value)


def local_path(path: str, graph_dir: Path) -> Path | None:
    """The file or folder a graph's path names, or None for a hub id (`org/name`, `hf://...`),
    which is resolved from the Hugging Face cache at run time. Relative paths are relative to the
    graph file."""
    if path.startswith("hf://"):
        return None
    candidate = (graph_dir / path).resolve()
    if Path(path).is_absolute() or candidate.exists() or path.startswith((".", "~")):
        return Path(path).expanduser() if path.startswith("~") else candidate
    return None


def _resolve_path(path: str, graph_dir: Path) -> str:
    local = local_path(path, graph_dir)
    return path if local is None else str(local)


def file_path(path: str, graph_dir: Path) -> str:
    """A file the graph names that can only be local (engine args, a Python engine), relative to
    the graph file: never a hub id, even when it does not exist (yet)."""
    return str((graph_dir / Path(path).expanduser()).resolve())


class _Compiler:
    def __init__(
        self, graph: Graph, graph_file: Path, state_dir: Path, nodes: Mapping[str, str] | None = None
    ) -> None:
        self.graph = graph
        self.nodes = nodes
        self.graph_dir = graph_file.parent.resolve()
        self.graph_file = graph_file.resolve()
        self.state_dir = state_dir.resolve()
        self.files: dict[str, str] = {}
        self.infra: list[ProcessSpec] = []
        self.next_gpu: dict[str, int] = {}  # host -> lowest GPU not yet given to an auto-placed replica
        self.named_gpus = self._named_gpus()
        self.standby: list[ProcessSpec] = []  # autoscaled replicas beyond `replicas` (Plan.standby)
        self.autoscale = self._autoscale_policies()
        self.multi_host = any(host != LOCAL for comp in graph.components.values() for host in _hosts_of(comp))
        self.tls = tls_on(graph, self.multi_host)
        self.tls_dir = str(tls_dir(self.state_dir))
        self.tls_names: dict[str, list[str]] = {}  # process -> the names its certificate holds

    def _infra_host(self, configured: str | None) -> str:
        """Where managed infra binds: as configured, else where other hosts can reach it."""
        if configured:
            return configured
        local = self.nodes[LOCAL] if self.nodes else self.graph.host(LOCAL).advertise_host
        return local if self.multi_host and local else "127.0.0.1"

    def _address(self, host: str) -> str | None:
        """The address other hosts reach `host` at, in a multi-host graph (None: loopback); on a
        scheduler's nodes, the node's (`nodes`)."""
        if not self.multi_host:
            return None
        if self.nodes is not None:
            return self.nodes[host]
        h = self.graph.host(host)
        return h.advertise_host or (h.ssh.address if h.ssh else None)

    def _host_env(self, host: str) -> dict[str, str]:
        """The host's own `env`; in a multi-host graph, workers also listen on and advertise their
        host's routable address (the request plane, and zmq KV event publishers)."""
        env = dict(sorted(self.graph.host(host).env.items()))
        if address := self._address(host):
            env |= {"DYN_TCP_HOST": address, "DYN_TCP_ADVERTISE_HOST": address}
        return env

    def _side_channels(
        self, worker: Worker, process: str, host: str
    ) -> tuple[dict[str, str], list[str], list[str]]:
        """Ports an engine opens beside our planes, one per process (env, port names, args), bound
        on its host's address: vLLM's NIXL handshake listener (of a worker with a KV connector),
        and an SGLang prefill worker's bootstrap server, where decode engines fetch its KV (its
        address goes in its card). A variable the graph sets (the host's or the component's
        `env`), or the port in engine_args, pins it instead."""
        pinned = {*worker.env, *self.graph.host(host).env}
        env: dict[str, str] = {}
        ports: list[str] = []
        args: list[str] = []
        if worker.engine == "sglang" and worker.role == "prefill":
            if "disaggregation_bootstrap_port" not in (worker.engine_args or {}):
                ports.append(f"{process}.bootstrap")
                args += ["--disaggregation-bootstrap-port", port_placeholder(ports[-1])]
            if "SGLANG_HOST_IP" not in pinned:  # the host the worker advertises (SGLang's get_ip)
                env["SGLANG_HOST_IP"] = self._address(host) or "127.0.0.1"
            return env, ports, args
        nixl = worker.role != "agg" or "kv_transfer_config" in (worker.engine_args or {})
        if worker.engine != "vllm" or not nixl:
            return env, ports, args
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in pinned:
            ports.append(f"{process}.nixl")
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = port_placeholder(ports[-1])
        if "VLLM_NIXL_SIDE_CHANNEL_HOST" not in pinned:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self._address(host) or "127.0.0.1"
        return env, ports, args

    # ---- runtime planes and infra ----------------------------------------------------------

    def planes_env(self) -> dict[str, str]:
        rt = self.graph.runtime
        env = {
            "DYN_DISCOVERY_BACKEND": rt.discovery,
            "DYN_REQUEST_PLANE": rt.request_plane,
            "DYN_EVENT_PLANE": rt.event_plane,
            "DYN_LEASE_TTL": f"{rt.lease_ttl_s:g}",
            "PYTHONHASHSEED": PYTHON_HASH_SEED,
        }
        if rt.discovery == "file":
            env["DYN_FILE_KV"] = str(self.state_dir / "discovery")
        etcd, nats = self.graph.infra.etcd, self.graph.infra.nats
        if etcd is not None:
            if etcd.managed:
                host = self._infra_host(etcd.host)
                env["ETCD_ENDPOINTS"] = (
                    f"{self._scheme('http')}://{host}:{_port(etcd.client_port, 'etcd.client')}"
                )
            else:
                env["ETCD_ENDPOINTS"] = ",".join(etcd.endpoints)
        if nats is not None:
            if nats.managed:
                host = self._infra_host(nats.host)
                env["NATS_SERVER"] = (
                    f"{'tls' if self.tls else 'nats'}://{host}:{_port(nats.port, 'nats.client')}"
                )
            elif nats.url:
                env["NATS_SERVER"] = nats.url
        return env

    def _scheme(self, plain: str) -> str:
        return f"{plain}s" if self.tls else plain

    def _tls_env(self, process: str, host: str, address: str | None) -> tuple[dict[str, str], list[str]]:
        """The paths of a process's CA, certificate and key, for each plane that uses them (with
        TLS off: none), and the variables to carry to a remote host; its certificate is issued
        for `address` (what others dial it at)."""
        if not self.tls:
            return {}, []
        self.tls_names[process] = [address] if address else []
        ca = ca_file(self.tls_dir)
        cert, key = cert_files(self.tls_dir, process)
        env = {ENV_CA: ca, ENV_CERT: cert, ENV_KEY: key}
        if self.graph.runtime.event_plane == "zmq":
            env["DYN_ZMQ_CURVE_KEY_FILE"] = curve_file(self.tls_dir)
        etcd, nats = self.graph.infra.etcd, self.graph.infra.nats
        if etcd is not None and etcd.managed:
            env |= {"ETCD_AUTH_CA": ca, "ETCD_AUTH_CLIENT_CERT": cert, "ETCD_AUTH_CLIENT_KEY": key}
        if nats is not None and nats.managed:
            env |= {"NATS_TLS_CA": ca, "NATS_TLS_CERT": cert, "NATS_TLS_KEY": key}
        carry = sorted(env) if host != LOCAL else []
        if etcd is not None and etcd.managed:
            env["ETCD_AUTH_SERVER_NAME"] = "etcd"
        if nats is not None and nats.managed:
            env["NATS_TLS_SERVER_NAME"] = "nats"
        return env, carry

    def _tracing_env(self, component: str) -> dict[str, str]:
        """The OpenTelemetry SDK's variables for `component`'s processes, from `observability`
        (none without an endpoint: tracing stays off); host and component `env` win over them."""
        settings = TracingSettings(**self.graph.observability.model_dump())
        if settings.otlp_endpoint is None:
            return {}
        return {
            **settings.otel_env({"otlp_endpoint", "sample_ratio"}),
            "OTEL_SERVICE_NAME": component,
            "OTEL_RESOURCE_ATTRIBUTES": f"service.namespace={self.graph.namespace}",
        }

    def infra_processes(self) -> list[ProcessSpec]:
        procs = []
        etcd, nats = self.graph.infra.etcd, self.graph.infra.nats
        never = RestartPolicy("on-failure", 5, 0.5, 5.0)
        if etcd is not None and etcd.managed:
            host = self._infra_host(etcd.host)
            client = f"{self._scheme('http')}://{host}:{_port(etcd.client_port, 'etcd.client')}"
            peer = f"{self._scheme('http')}://{host}:{_port(etcd.peer_port, 'etcd.peer')}"
            tls_argv: list[str] = []
            if self.tls:
                self.tls_names["etcd"] = [host, "etcd"]  # the name its clients expect (graph/tls.py)
                cert, key = cert_files(self.tls_dir, "etcd")
                ca = ca_file(self.tls_dir)
                for side in ("", "peer-"):  # clients and the (one-member) peer port alike
                    tls_argv += [f"--{side}cert-file", cert, f"--{side}key-file", key]
                    tls_argv += [f"--{side}trusted-ca-file", ca, f"--{side}client-cert-auth"]
            procs.append(
                ProcessSpec(
                    name="etcd",
                    component="etcd",
                    replica=0,
                    host=LOCAL,
                    argv=[
                        "etcd",
                        "--name",
                        "dyngraph",
                        "--data-dir",
                        str(self.state_dir / "etcd"),
                        "--listen-client-urls",
                        client,
                        "--advertise-client-urls",
                        client,
                        "--listen-peer-urls",
                        peer,
                        "--initial-advertise-peer-urls",
                        peer,
                        "--initial-cluster",
                        f"dyngraph={peer}",
                        "--initial-cluster-state",
                        "new",
                        "--logger",
                        "zap",
                        "--log-level",
                        "error",
                        # One member, no peers: short ticks elect the leader in ~0.1 s, not ~1 s.
                        "--heartbeat-interval",
                        "25",
                        "--election-timeout",
                        "250",
                        *tls_argv,
                    ],
                    env={},
                    workdir=str(self.state_dir),
                    ports={"etcd.client": etcd.client_port, "etcd.peer": etcd.peer_port},
                    depends_on=[],
                    # /health wants a client certificate under TLS: then the port accepting is the sign.
                    readiness=Probe("tcp", client.partition("://")[2], 30.0)
                    if self.tls
                    else Probe("http", f"{client}/health", 30.0),
                    restart=never,
                    shutdown_grace_s=5.0,
                )
            )
        if nats is not None and nats.managed:
            host = self._infra_host(nats.host)
            argv = ["nats-server", "-a", host, "-p", _port(nats.port, "nats.client")]
            if nats.jetstream:
                argv += ["-js", "-sd", str(self.state_dir / "nats")]
            if self.tls:
                self.tls_names["nats"] = [host, "nats"]
                cert, key = cert_files(self.tls_dir, "nats")
                argv += ["--tls", "--tlscert", cert, "--tlskey", key, "--tlscacert", ca_file(self.tls_dir)]
                argv.append("--tlsverify")  # a client certificate of the graph's CA, or no connection
            procs.append(
                ProcessSpec(
                    name="nats",
                    component="nats",
                    replica=0,
                    host=LOCAL,
                    argv=argv,
                    env={},
                    workdir=str(self.state_dir),
                    ports={"nats.client": nats.port},
                    depends_on=[],
                    readiness=Probe("tcp", f"{host}:{_port(nats.port, 'nats.client')}", 30.0),
                    restart=never,
                    shutdown_grace_s=5.0,
                )
            )
        return procs

    # ---- components --------------------------------------------------------------------------

    def _common(self, name: str) -> tuple[list[str], RestartPolicy]:
        comp = self.graph.components[name]
        deps = [d for dep in sorted(comp.depends_on) for d in self._process_names(dep)]
        r = comp.restart
        return [p.name for p in self.infra] + deps, RestartPolicy(
            r.policy, r.max_restarts, r.backoff_s, r.backoff_max_s
        )

    def _rollout(self, name: str) -> RolloutPolicy:
        rollout = self.graph.components[name].rollout or self.graph.rollout
        policy = rollout.model_dump()
        if policy["strategy"] == "canary" and not self._can_canary(name):
            policy["strategy"] = "rolling"  # the graph-wide canary is for the workers that can be one
        return RolloutPolicy(**{**policy, "steps": tuple(policy["steps"])})

    def _can_canary(self, name: str) -> bool:
        """Only a dynamic worker's requests can be split between revisions (schema.py refuses a
        component's own canary elsewhere)."""
        comp = self.graph.components[name]
        return isinstance(comp, Worker) and not comp.static

    def _process_names(self, component: str) -> list[str]:
        comp = self.graph.components[component]
        return [f"{component}-{i}" for i in range(comp.replicas)]

    def _workdir(self, host: str) -> str:
        """Local: relative to the graph file. Remote: as written (the remote resolves `~`)."""
        workdir = self.graph.host(host).workdir
        if host != LOCAL and self.nodes is None:
            return workdir or REMOTE_HOME
        return _resolve_path(workdir, self.graph_dir) if workdir else str(self.graph_dir)

    def remote_hosts(self) -> dict[str, RemoteHost]:
        """Connection and interpreter of every remote host a process runs on."""
        used = {p for comp in self.graph.components.values() for p in _hosts_of(comp)} - {LOCAL}
        hosts: dict[str, RemoteHost] = {}
        if self.nodes is not None:
            return hosts  # the scheduler starts them
        for key in sorted(used):
            h = self.graph.host(key)
            if h.ssh is None:
                continue  # a node of a Slurm job (`slurm:`): only `up --target slurm` runs it
            python = f"{h.venv.rstrip('/')}/bin/python" if h.venv else h.python or "python3"
            hosts[key] = RemoteHost(
                address=h.ssh.address,
                port=h.ssh.port,
                user=h.ssh.user,
                identity_file=_resolve_path(h.ssh.identity_file, self.graph_dir)
                if h.ssh.identity_file
                else None,
                known_hosts=_resolve_path(h.ssh.known_hosts, self.graph_dir) if h.ssh.known_hosts else None,
                host_key=h.ssh.host_key,
                python=python,
            )
        return hosts

    def local_python(self) -> str | None:
        """`hosts.local.venv`'s python or `hosts.local.python` (a path relative to the graph file,
        or a name looked up on PATH); None when neither is given."""
        local = self.graph.host(LOCAL)
        if local.venv:
            return str(Path(file_path(local.venv, self.graph_dir)) / "bin" / "python")
        if local.python and "/" in local.python:
            return file_path(local.python, self.graph_dir)
        return local.python

    def frontend(self, name: str, comp: Frontend) -> list[ProcessSpec]:
        out = "auto"
        endpoints = {
            str(w.endpoint_name())
            for w in self.graph.workers().values()
            if comp.models is None or w.model in comp.models
        }
        serves_workers = bool(endpoints)
        if comp.models is not None and len(endpoints) == 1:
            out = endpoints.pop()  # serve just that endpoint's workers
        # The component's one port, which every replica binds (named after the first for the
        # ports a running graph already has).
        port_name = f"{name}-0.http"
        http_port = _port(comp.http.port, port_name)
        argv = [
            "dyngraph",
            "run",
            "in=http",
            f"out={out}",
            "--http-host",
            comp.http.host,
            "--http-port",
            http_port,
            *to_argv(RouterConfig(**comp.router.model_dump())),
            *to_argv(DisaggConfig(**comp.disagg.model_dump())),
            *to_argv(LimitSettings(**comp.limits.model_dump())),
            *to_argv(RecordSettings(**comp.record.model_dump())),
        ]
        if (https := comp.http.tls) is not None:
            served = https.model_dump(exclude={"ca_file"})  # the CA is the scraper's, not the server's
            files = {key: file_path(path, self.graph_dir) for key, path in served.items()}
            argv += to_argv(HttpTlsSettings(**files))
        if comp.auth.keys_file is not None:  # the path only: the file holds hashes, never keys
            argv += to_argv(AuthSettings(keys_file=file_path(comp.auth.keys_file, self.graph_dir)))
        if comp.migration_limit is not None:
            argv += ["--migration-limit", str(comp.migration_limit)]
        # Keys reach the frontend only through its environment: the plan names the variables.
        auth_env = {"DYN_API_KEY_ENV": ",".join(comp.api_key_env)} if comp.api_key_env else {}
        depends_on, restart = self._common(name)
        probe_host = "127.0.0.1" if comp.http.host in ("0.0.0.0", "::") else comp.http.host
        # /health answers 200 once a model is listed, so "ready" means "serving", while frontend
        # and workers start in parallel; a frontend with no workers in the graph is ready when live.
        scheme = "https" if comp.http.tls is not None else "http"
        probe_url = f"{scheme}://{probe_host}:{http_port}{'/health' if serves_workers else '/live'}"
        probe = Probe("http", probe_url, comp.readiness.timeout_s)
        if scheme == "https" and comp.host != LOCAL:  # a probe through ssh speaks no TLS: the port it is
            probe = Probe("tcp", f"{probe_host}:{http_port}", comp.readiness.timeout_s)
        env = {
            **self.planes_env(),
            **self._tracing_env(name),
            **self._host_env(comp.host),
            # Streams in flight finish within this on SIGTERM (a rollout retiring the old run),
            # before the supervisor's SIGKILL at shutdown_grace_s.
            "DYN_SHUTDOWN_GRACE_S": _inner_grace(comp.shutdown_grace_s),
            **dict(sorted(comp.env.items())),
            **auth_env,
        }
        if comp.replicas > 1:  # replicas answer /metrics for each other (frontend/group.py)
            env[GROUP_ENV] = f"{self.graph.namespace}.{name}"
        tls = [
            self._tls_env(f"{name}-{replica}", comp.host, self._address(comp.host))
            for replica in range(comp.replicas)
        ]
        return [
            ProcessSpec(
                name=f"{name}-{replica}",
                component=name,
                replica=replica,
                host=comp.host,
                argv=list(argv),
                env={**env, **tls[replica][0]},
                carry=tls[replica][1],
                workdir=self._workdir(comp.host),
                ports={port_name: comp.http.port},
                depends_on=depends_on,
                readiness=probe,
                restart=restart,
                shutdown_grace_s=comp.shutdown_grace_s,
                rollout=self._rollout(name),
                rolls=True,  # the new frontend binds the same port (SO_REUSEPORT) before the old stops
                shares_ports=True,
            )
            for replica in range(comp.replicas)
        ]

    def _engine_args_file(self, name: str, worker: Worker) -> str | None:
        if worker.engine_args_file is not None:
            return file_path(worker.engine_args_file, self.graph_dir)
        if worker.engine_args is None:
            return None
        path = str(self.state_dir / "engine-args" / f"{name}.json")
        self.files[path] = json.dumps(worker.engine_args, indent=2, sort_keys=True) + "\n"
        return path

    def _named_gpus(self) -> dict[str, set[int]]:
        """GPUs that components name (`gpu_ids`, `base_gpu_id`) on each host: never auto-assigned."""
        named: dict[str, set[int]] = {}
        for worker in self.graph.workers().values():
            per, gpus = worker.gpus_per_node, worker.gpus
            if per == 0 or (gpus.gpu_ids is None and gpus.base_gpu_id is None):
                continue
            slots: dict[str, int] = {}
            for host in worker.hosts_of_replicas():
                slot = slots[host] = slots.get(host, -1) + 1
                named.setdefault(host, set()).update(self._explicit_gpus(worker, slot))
        return named

    @staticmethod
    def _explicit_gpus(worker: Worker, slot: int) -> list[int]:
        per, gpus = worker.gpus_per_node, worker.gpus
        if gpus.gpu_ids is not None:
            return gpus.gpu_ids[slot * per : (slot + 1) * per]
        assert gpus.base_gpu_id is not None
        return list(range(gpus.base_gpu_id + slot * per, gpus.base_gpu_id + (slot + 1) * per))

    def _gpu_env(self, worker: Worker, host: str, slot: int) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES of the `slot`-th process of `worker` on `host`."""
        per = worker.gpus_per_node
        if per == 0:
            return {}
        if worker.gpus.gpu_ids is not None or worker.gpus.base_gpu_id is not None:
            ids = self._explicit_gpus(worker, slot)
        else:
            ids = []
            gpu = self.next_gpu.get(host, 0)
            while len(ids) < per:
                if gpu not in self.named_gpus.get(host, set()):
                    ids.append(gpu)
                gpu += 1
            self.next_gpu[host] = gpu
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids)}

    def _autoscale_policies(self) -> dict[str, AutoscalePolicy]:
        """Each autoscaled worker's policy, its `max_replicas` cut to what fits: the GPUs its
        hosts declare less what every worker's `replicas` use, and the graph's `max_gpus`
        (autoscaled pools take what is left in component order)."""
        workers = self.graph.workers()
        used: dict[str, int] = {}
        for worker in workers.values():
            for host in worker.hosts_of_replicas():
                used[host] = used.get(host, 0) + worker.gpus_per_node
        budget = self.graph.max_gpus
        left = None if budget is None else budget - sum(used.values())
        policies = {}
        for name in sorted(workers):
            worker = workers[name]
            scale = worker.autoscale
            if scale is None:
                continue
            per, fits, capped = worker.gpus_per_node, worker.replicas, ""
            while fits < scale.max_replicas and per:
                hosts = worker.hosts_of_replica(fits)
                full = [h for h in hosts if used.get(h, 0) + per > self.graph.host(h).gpus]
                if full:
                    have = self.graph.host(full[0]).gpus
                    capped = f"host {full[0]!r} has {have} GPU(s) and {per} per replica"
                    break
                if left is not None and left < per * len(hosts):
                    capped = f"max_gpus is {budget}"
                    break
                for host in hosts:
                    used[host] = used.get(host, 0) + per
                left = None if left is None else left - per * len(hosts)
                fits += 1
            fits = fits if per else scale.max_replicas
            policies[name] = AutoscalePolicy(
                min_replicas=scale.min_replicas,
                max_replicas=fits,
                wanted_max=scale.max_replicas,
                capped=capped,
                ttft_p90_ms=scale.target.ttft_p90_ms,
                itl_p90_ms=scale.target.itl_p90_ms,
                interval_s=scale.interval_s,
                scale_down_delay_s=scale.scale_down_delay_s,
                role=worker.role,
                kv_usage=scale.target.kv_usage,
                waiting_requests=scale.target.waiting_requests,
                queued_prefill_tokens=scale.target.queued_prefill_tokens,
            )
        return policies

    def workers(self, name: str, worker: Worker) -> list[ProcessSpec]:
        """The processes of the worker's `replicas`; an autoscaled one's further replicas, up to
        the most that fit, go to `standby`."""
        policy = self.autoscale.get(name)
        if policy is None:
            return self._replicas(name, worker)
        procs = self._replicas(name, worker.model_copy(update={"replicas": policy.max_replicas}))
        self.standby += [p for p in procs if p.replica >= worker.replicas]  # each replica's every rank
        return [p for p in procs if p.replica < worker.replicas]

    def _replicas(self, name: str, worker: Worker) -> list[ProcessSpec]:
        model = self.graph.models[worker.model]
        engine = worker.engine
        if (given := engine_file(engine)) is not None:
            prefix, path = given
            engine = prefix + file_path(path, self.graph_dir)
        adapters = (f"{a}={_resolve_path(p, self.graph_dir)}" for a, p in (model.lora_adapters or {}).items())
        args_file = self._engine_args_file(name, worker)
        engine_settings = EngineSettings(
            model_path=_resolve_path(model.path, self.graph_dir),
            model_name=str(model.name),
            model_config=_resolve_path(model.config, self.graph_dir) if model.config else None,
            context_length=model.context_length or None,
            kv_cache_block_size=model.kv_cache_block_size or None,
            extra_engine_args=Path(args_file) if args_file else None,
            tensor_parallel_size=worker.gpus.tensor_parallel_size,
            disaggregation_mode=worker.role,
            lora_modules=",".join(adapters) or None,
            embedding=worker.embedding,
        )
        given = {"migration_limit": worker.migration_limit, "max_inflight": worker.max_inflight}
        worker_settings = WorkerSettings(
            static_worker=worker.static,
            dyn_tool_call_parser=model.tool_call_parser,
            dyn_reasoning_parser=model.reasoning_parser,
            **{key: value for key, value in given.items() if value is not None},  # None: the default
        )
        argv = ["dyngraph", "run", f"in={worker.endpoint_name()}", f"out={engine}"]
        depends_on, restart = self._common(name)
        pairing = self._pairing(worker, engine) if worker.role in ("prefill", "decode") else ""
        procs: list[ProcessSpec] = []
        on_host: dict[str, int] = {}
        mpi = worker.nodes > 1 and worker.engine == "trtllm"  # one MPI world (ProcessSpec.mpi_hosts)
        if mpi:
            argv = ["trtllm-llmapi-launch", *argv]
        for replica in range(worker.replicas):
            hosts = worker.hosts_of_replica(replica)
            mpi_hosts = hosts if mpi else []
            if mpi:  # one process: the world's sizes are the engine's, no leader address to meet at
                hosts = hosts[:1]
            group = f"{name}-{replica}" if worker.nodes > 1 and not mpi else ""
            rendezvous = f"{name}-{replica}.leader"
            leader = f"{self._address(hosts[0]) or '127.0.0.1'}:{port_placeholder(rendezvous)}"
            for rank, host in enumerate(hosts):
                slot = on_host[host] = on_host.get(host, -1) + 1
                ranked = engine_settings
                if group:
                    ranked = dataclasses.replace(
                        engine_settings, num_nodes=worker.nodes, node_rank=rank, leader_addr=leader
                    )
                spec = ProcessSpec(
                    name=f"{name}-{replica}" if rank == 0 else f"{name}-{replica}.rank{rank}",
                    component=name,
                    replica=replica,
                    host=host,
                    argv=[*argv, *to_argv(ranked), *to_argv(worker_settings)],
                    env={},
                    workdir=self._workdir(host),
                    ports={rendezvous: "auto"} if group and rank == 0 else {},
                    depends_on=depends_on,
                    readiness=Probe(
                        "log", FOLLOWING if rank else "serving model", worker.readiness.timeout_s
                    ),
                    restart=restart,
                    shutdown_grace_s=worker.shutdown_grace_s,
                    role=worker.role,
                    rollout=self._rollout(name),
                    rolls=not worker.static,  # a static worker's fixed address is taken until it stops
                    pairing=pairing,
                    group=group,
                    rank=rank,
                    mpi_hosts=mpi_hosts,
                    mpi_tasks=worker.model_ranks() // worker.nodes if mpi else 0,
                )
                procs.append(self._worker_process(name, worker, spec, slot, len(procs)))
        return procs

    def _worker_process(
        self, name: str, worker: Worker, spec: ProcessSpec, slot: int, index: int
    ) -> ProcessSpec:
        """A worker process's environment and ports: its planes, GPUs (the `slot`-th on its host),
        side channels, TLS files and `/metrics` (fixed ports count by `index`, the process's place
        among the worker's)."""
        process, host = spec.name, spec.host
        env = {
            **self.planes_env(),
            **self._tracing_env(name),
            **self._host_env(host),
            **self._gpu_env(worker, host, slot),
            # In-flight requests get the grace, minus time to end the rest (so they migrate)
            # before the supervisor's SIGKILL at shutdown_grace_s.
            "DYN_SHUTDOWN_GRACE_S": _inner_grace(worker.shutdown_grace_s),
            **dict(sorted(worker.env.items())),
        }
        if spec.group and worker.engine == "vllm":  # where the other ranks reach this one's workers
            env.setdefault("VLLM_HOST_IP", self._address(host) or "127.0.0.1")
        side_env, side_ports, side_args = self._side_channels(worker, process, host)
        tls_env, carry = self._tls_env(process, host, self._address(host))
        env = {**side_env, **env, **tls_env}  # the graph's own `env` (above) wins over side channels
        ports: dict[str, int | str] = {**spec.ports, **dict.fromkeys(side_ports, "auto")}
        metrics_args: list[str] = []
        if worker.metrics_port is not None:
            if self.tls:  # whatever address Prometheus scrapes, it checks this name
                self.tls_names[process].append(METRICS_NAME)
                env[ENV_METRICS_CA] = ca_file(self.tls_dir, SCRAPE_CA)  # its clients'
                if host != LOCAL:
                    carry = sorted([*carry, ENV_METRICS_CA])
            port = "auto" if worker.metrics_port == "auto" else worker.metrics_port + index
            port_name = f"{process}.metrics"
            ports[port_name] = port
            bind = self._address(host) or "127.0.0.1"
            metrics_args = ["--metrics-port", _port(port, port_name), "--metrics-host", bind]
        if worker.static:
            port = worker.tcp_port + index if worker.tcp_port else "auto"
            port_name = f"{process}.tcp"
            ports[port_name] = port
            env["DYN_TCP_PORT"] = _port(port, port_name)
        return msgspec.structs.replace(
            spec, argv=[*spec.argv, *metrics_args, *side_args], env=env, ports=ports, carry=carry
        )

    def _engine_args_from_file(self, worker: Worker) -> dict[str, object]:
        """A worker's `engine_args_file` as read now ({} when unreadable: preflight says why)."""
        if worker.engine_args_file is None:
            return {}
        try:
            loaded = yaml.safe_load(Path(file_path(worker.engine_args_file, self.graph_dir)).read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def _pairing(self, worker: Worker, engine: str) -> str:
        """What a model's prefill and decode workers must share for KV to move between them."""
        model = self.graph.models[worker.model]
        args = worker.engine_args or self._engine_args_from_file(worker)
        shared = {
            "model": [model.path, model.config, model.context_length, model.kv_cache_block_size],
            "engine": engine,
            "engine_args": {k: args[k] for k in sorted(KV_SHAPING_ENGINE_ARGS) if k in args},
        }
        digest = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()
        return f"{model.name}@{digest[:12]}"

    def plan(self) -> Plan:
        self.infra = self.infra_processes()
        processes = list(self.infra)
        for name in sorted(self.graph.components):
            comp = self.graph.components[name]
            if isinstance(comp, Frontend):
                processes += self.frontend(name, comp)
            else:
                processes += self.workers(name, comp)
        assert self.graph.namespace is not None
        checked = any(p.rollout.checks for p in processes)
        return Plan(
            graph=self.graph.name,
            namespace=self.graph.namespace,
            graph_file=str(self.graph_file),
            state_dir=str(self.state_dir),
            files=dict(sorted(self.files.items())),
            processes=processes,
            hosts=self.remote_hosts(),
            local_python=self.local_python(),
            graph_json=self.graph.model_dump_json(exclude_unset=True) if checked else "",
            autoscale=self.autoscale,
            standby=self.standby,
            supervisor_metrics=self._supervisor_metrics(),
            tls=self._tls_plan(),
        )

    def _tls_plan(self) -> TlsPlan | None:
        """Every certificate to issue: the processes', the supervisor's for its /metrics, and
        Prometheus's (a client's) for scraping them."""
        if not self.tls:
            return None
        names = {**self.tls_names, SCRAPER: []}
        if (metrics := self._supervisor_metrics()) is not None:
            names[SUPERVISOR] = [metrics[0], METRICS_NAME]
        return TlsPlan(self.tls_dir, dict(sorted(names.items())))

    def _supervisor_metrics(self) -> tuple[str, int] | None:
        endpoint = self.graph.supervisor
        return None if endpoint.metrics_port is None else (endpoint.metrics_host, endpoint.metrics_port)


def tls_on(graph: Graph, multi_host: bool) -> bool:
    """Whether `security.tls` turns TLS on for this graph (`auto`: when it spans hosts)."""
    mode = graph.security.tls
    return mode == "required" or (mode == "auto" and multi_host)


def _hosts_of(comp: Frontend | Worker) -> list[str]:
    """Where the component's processes may run (every host of an autoscaled one's placement)."""
    if isinstance(comp, Worker):
        return list(comp.placement) if comp.autoscale is not None else comp.hosts_of_replicas()
    return [comp.host]


def compile_graph(
    graph: Graph, *, graph_file: Path, state_dir: Path, nodes: Mapping[str, str] | None = None
) -> Plan:
    """The launch plan of a validated graph (deterministic). `nodes` (host key -> address) is for
    a scheduler that places hosts on nodes sharing this filesystem (graph/targets/slurm/): addresses come
    from it, workdirs are as on the local host, and no host is reached over ssh."""
    return _Compiler(graph, graph_file, state_dir, nodes).plan()


def _inner_grace(shutdown_grace_s: float) -> str:
    """A process's own grace for streams in flight: the supervisor's, less the time it needs to
    end the rest (a worker's unfinished streams migrate) before SIGKILL."""
    return f"{max(shutdown_grace_s - 3.0, 0.0):g}"
