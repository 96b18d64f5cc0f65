"""`render -f k8s`: the graph as plain Kubernetes manifests that run its compiled plan.

Each container runs the same `dyngraph run ...` command line `dyngraph up` would (compile.py),
with what changes in a cluster changed: models and engine files at their in-cluster paths, the
frontend bound to all interfaces behind a Service, workers advertising their pod IP (downward
API), etcd and nats-server as StatefulSets reached by Service DNS names. Kubernetes does what
the supervisor does on a host: it restarts containers and places pods, so the graph's restart
policies and hosts have no part here.

Objects per graph: a Deployment per worker component (replicas, `nvidia.com/gpu` from
`gpus.per_replica`; a LeaderWorkerSet of groups of `nodes` pods, GPUs per node, for a worker whose
replicas span nodes), a Deployment and a Service per frontend, a StatefulSet and Service per
in-cluster etcd/nats, one ConfigMap with the engine-args and engine files, and the models'
claim unless the graph names one. Secret values never appear: secret-looking variables and API
key variables are `secretKeyRef`s into the graph's Secret (common.env_vars).

With `security.tls` on, every pod mounts the Secret `<graph>-tls` (`ca.crt`, `tls.crt`, `tls.key`,
as a cert-manager Certificate writes it, plus `curve.key` for a zmq event plane): the manifests
refer to it and never hold key material; the header says what it must contain. etcd and
nats-server then serve TLS with client certificates, as under `up`.

File discovery (the one-machine default) cannot span pods, so such a graph gets an in-cluster
etcd; the header comment says so, and lists what else was changed or left out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dynamo_graph.engines.registry import engine_file
from dynamo_graph.frontend.settings import GROUP_ENV
from dynamo_graph.graph.compile import compile_graph, file_path, local_path
from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import Plan, ProcessSpec
from dynamo_graph.graph.schema import Frontend, Graph, Worker
from dynamo_graph.graph.targets.k8s.common import (
    COMPONENT,
    PART_OF,
    component_names,
    dump_documents,
    env_vars,
    hf_home,
    k8s_name,
    metadata,
    model_path,
    models_claim,
    models_mount,
    models_volume,
    pod_defaults,
    secret_name,
    uses_models_volume,
)

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
NATS_IMAGE = "nats:2.10-alpine"
ETCD_PORT, ETCD_PEER_PORT, NATS_PORT = 2379, 2380, 4222
WORKER_PORT = 9345
"""Request-plane port of every worker pod: each pod has its own IP, so one fixed port serves all
replicas and gives the probes something to check (a worker listens once it serves)."""
WORKER_METRICS_PORT = 9090
"""A worker pod's /metrics (`metrics_port`), on Dynamo's system port: one port for every pod."""
RENDEZVOUS_PORT = 29500
"""Where a multi-node replica's leader pod waits for its other ranks (torch.distributed's port)."""
FILES_DIR = "/etc/dyngraph"
TLS_DIR = "/etc/dyngraph-tls"  # the `<graph>-tls` Secret's mount
# A file of the plan's TLS folder -> its key in the Secret (every pod shares one certificate; the
# Secret has no scraper CA, so a pod's /metrics trusts the graph's CA for its clients).
_TLS_KEYS = {
    "ca.crt": "ca.crt",
    "scrape-ca.crt": "ca.crt",
    "curve.key": "curve.key",
    ".crt": "tls.crt",
    ".key": "tls.key",
}
KEYS_DIR = "/etc/dyngraph-keys"  # a frontend's keys file, from the graph's Secret
PROBE_PERIOD_S = 5
# Set per pod from the graph's planes and the pod's own address, never copied from the plan.
_HOST_ONLY_ENV = {
    "DYN_FILE_KV",
    "CUDA_VISIBLE_DEVICES",
    "DYN_TCP_HOST",
    "DYN_TCP_ADVERTISE_HOST",
    "DYN_TCP_PORT",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "SGLANG_HOST_IP",
    GROUP_ENV,  # a frontend's replicas are pods here, each alone in its own
}


class _K8s:
    def __init__(self, graph: Graph, plan: Plan) -> None:
        self.graph, self.plan = graph, plan
        self.base = k8s_name(graph.name)
        self.names = component_names(graph)
        self.graph_dir = Path(plan.graph_file).parent
        self.files: dict[str, str] = {}  # ConfigMap key -> text
        self.paths: dict[str, str] = {}  # a path in the plan -> where the pod sees it
        self.notes: list[str] = []
        self.etcd = graph.runtime.discovery == "file" or bool(graph.infra.etcd and graph.infra.etcd.managed)
        self.nats = bool(graph.infra.nats and graph.infra.nats.managed)
        self.volume = uses_models_volume(graph, plan)
        self.tls = plan.tls is not None
        self._check()

    def _check(self) -> None:
        workers = sorted(self.graph.workers().items())
        problems = [
            Problem(f"components.{k}.static", "static workers are not rendered for Kubernetes")
            for k, w in workers
            if w.static
        ]
        problems += [
            Problem(
                f"components.{k}.nodes",
                "a TensorRT-LLM replica over nodes is one MPI job, not a LeaderWorkerSet of ranks: "
                "render it with `-f dynamo-k8s` (Dynamo's operator launches it under mpirun)",
            )
            for k, w in workers
            if w.nodes > 1 and w.engine == "trtllm"
        ]
        if problems:
            raise GraphError(problems)
        if self.graph.runtime.discovery == "file":
            self.notes.append(
                "runtime.discovery file cannot span pods: discovery goes through an in-cluster etcd"
            )
        if any(w.placement != ["local"] for w in self.graph.workers().values()):
            self.notes.append("hosts and placement: the Kubernetes scheduler places the pods")
        if self.tls:
            self.notes.append(
                f"security.tls: every pod mounts Secret {self.base}-tls, which is not rendered: create "
                "it (a cert-manager Certificate of the graph's own CA) with ca.crt, tls.crt and tls.key, "
                f"the certificate naming etcd, nats and the Services ({self.base}-*), for client and "
                "server auth"
                + (
                    ", and curve.key (a zmq CURVE secret key)"
                    if self.graph.runtime.event_plane == "zmq"
                    else ""
                )
            )

    # ---- files and paths ---------------------------------------------------------------------

    def _file(self, key: str, text: str) -> str:
        self.files[key] = text
        return f"{FILES_DIR}/{key}"

    def _map_paths(self) -> None:
        for key, model in self.graph.models.items():
            local = local_path(model.path, self.graph_dir)
            if local is not None:
                self.paths[str(local)] = model_path(self.graph, self.plan, key)
            # Beside the models, each under its own name: a model's config folder, its LoRA adapters.
            mount = self.graph.kubernetes.models.mount_path.rstrip("/")
            extra = [model.config] if model.config else []
            for path in [*extra, *model.lora_adapters.values()]:
                local = local_path(path, self.graph_dir)
                if local is not None:
                    self.paths[str(local)] = f"{mount}/{local.name}"
        for key, frontend in sorted(self.graph.frontends().items()):
            if frontend.auth.keys_file is not None:
                self.paths[file_path(frontend.auth.keys_file, self.graph_dir)] = f"{KEYS_DIR}/keys.yaml"
                secret = secret_name(self.graph)
                self.notes.append(
                    f"components.{key}.auth.keys_file: the pods read it from Secret {secret}, key "
                    f"{key}-keys.yaml (kubectl create secret generic {secret} "
                    f"--from-file={key}-keys.yaml=PATH ...); an updated Secret is reloaded"
                )
        for path, text in self.plan.files.items():  # inline engine args
            self.paths[path] = self._file(Path(path).name, text)
        for key, worker in sorted(self.graph.workers().items()):
            engine = (engine_file(worker.engine) or ("", None))[1]
            for name, value in ((f"{key}.json", worker.engine_args_file), (f"{key}.py", engine)):
                local = (
                    local_path(value, self.graph_dir) if value and value.endswith((".json", ".py")) else None
                )
                if local is not None:
                    self.paths[str(local)] = self._file(name, local.read_text())

    def _argv(self, proc: ProcessSpec) -> list[str]:
        argv = []
        for arg in proc.argv:
            prefix, eq, value = arg.partition("=")
            kind, file = (engine_file(value) if prefix == "out" else None) or ("", value)
            if eq and file in self.paths:  # out=/path/engine.py, out=pytok:/path/engine.py
                argv.append(f"{prefix}={kind}{self.paths[file]}")
            else:
                argv.append(self.paths.get(arg, arg))
        if "--lora-modules" in argv:  # NAME=PATH,NAME=PATH
            at = argv.index("--lora-modules") + 1
            pairs = (entry.partition("=") for entry in argv[at].split(","))
            argv[at] = ",".join(f"{name}={self.paths.get(path, path)}" for name, _, path in pairs)
        if "--http-host" in argv:  # the Service reaches the pod on its own IP
            argv[argv.index("--http-host") + 1] = "0.0.0.0"
        if "--metrics-port" in argv:  # scraped on the pod's own IP, at one port for all pods
            at = argv.index("--metrics-port")
            if "{port:" in argv[at + 1]:
                argv[at + 1] = str(WORKER_METRICS_PORT)
            argv[argv.index("--metrics-host") + 1] = "0.0.0.0"
        if "--leader-addr" in argv:  # LWS gives every pod of a group its leader pod's address
            argv[argv.index("--leader-addr") + 1] = f"$(LWS_LEADER_ADDRESS):{RENDEZVOUS_PORT}"
        if "--node-rank" in argv:  # and its own place in the group
            argv[argv.index("--node-rank") + 1] = "$(LWS_WORKER_INDEX)"
        if "--disaggregation-bootstrap-port" in argv:  # a pod has SGLang's default port to itself
            at = argv.index("--disaggregation-bootstrap-port")
            if "{port:" in argv[at + 1]:
                del argv[at : at + 2]
        return argv

    # ---- environment -------------------------------------------------------------------------

    def _env(self, proc: ProcessSpec, comp: Frontend | Worker) -> list[dict[str, Any]]:
        # Ports `up` gives out per host ({port:NAME}) are not needed: each pod has its own network.
        env = {
            k: self._tls_path(v) for k, v in proc.env.items() if k not in _HOST_ONLY_ENV and "{port:" not in v
        }
        if self.etcd:
            env["DYN_DISCOVERY_BACKEND"] = "etcd"
            env["ETCD_ENDPOINTS"] = f"{'https' if self.tls else 'http'}://{self.base}-etcd:{ETCD_PORT}"
        if self.nats:
            env["NATS_SERVER"] = f"{'tls' if self.tls else 'nats'}://{self.base}-nats:{NATS_PORT}"
        if isinstance(comp, Worker):
            env["DYN_TCP_PORT"] = str(WORKER_PORT)
            if self.volume:
                env.update(hf_home(self.graph))
        secrets = comp.api_key_env if isinstance(comp, Frontend) else []
        out = env_vars(self.graph, env, list(secrets))
        if isinstance(comp, Worker):
            pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
            out += [{"name": "DYN_TCP_ADVERTISE_HOST", **pod_ip}, {"name": "DYN_TCP_HOST", **pod_ip}]
            if "VLLM_NIXL_SIDE_CHANNEL_HOST" in proc.env:  # where decode pods reach this one's NIXL
                out.append({"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", **pod_ip})
            if "SGLANG_HOST_IP" in proc.env:  # the bootstrap address an SGLang prefill pod publishes
                out.append({"name": "SGLANG_HOST_IP", **pod_ip})
        return sorted(out, key=lambda e: e["name"])

    def _tls_path(self, value: str) -> str:
        """A path into the plan's TLS folder -> the same file in the mounted Secret."""
        if self.plan.tls is None or not value.startswith(self.plan.tls.dir + "/"):
            return value
        name = value.rsplit("/", 1)[1]
        key = _TLS_KEYS.get(name) or _TLS_KEYS["." + name.rsplit(".", 1)[1]]
        return f"{TLS_DIR}/{key}"

    def _tls_volume(self) -> list[dict[str, Any]]:
        return (
            [{"name": "tls", "secret": {"secretName": f"{self.base}-tls", "defaultMode": 0o400}}]
            if self.tls
            else []
        )

    def _tls_mount(self) -> list[dict[str, Any]]:
        return [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if self.tls else []

    # ---- objects -----------------------------------------------------------------------------

    def _probes(self, comp: Frontend | Worker, proc: ProcessSpec) -> dict[str, Any]:
        """Startup allows the readiness timeout; then readiness and liveness as in the plan: a
        frontend by HTTP (`/health` once it lists a model, `/live`), a worker by its listening
        request-plane port (the nats plane gives it none, so no probe)."""
        if proc.rank > 0:  # a follower serves no port; its group is ready when its leader is
            return {}
        if isinstance(comp, Frontend):
            path = "/" + proc.readiness.target.rsplit("/", 1)[-1]
            ready: dict[str, Any] = {"httpGet": {"path": path, "port": "http"}}
            live: dict[str, Any] = {"httpGet": {"path": "/live", "port": "http"}}
        elif self.graph.runtime.request_plane == "tcp":
            ready = live = {"tcpSocket": {"port": "request-plane"}}
        else:
            self.notes.append(f"components.{proc.component}: nats request plane, no worker probe")
            return {}
        threshold = max(1, math.ceil(comp.readiness.timeout_s / PROBE_PERIOD_S))
        return {
            "startupProbe": {**ready, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": threshold},
            "readinessProbe": {**ready, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 3},
            "livenessProbe": {**live, "periodSeconds": 4 * PROBE_PERIOD_S, "failureThreshold": 3},
        }

    def _container(self, comp: Frontend | Worker, proc: ProcessSpec) -> dict[str, Any]:
        container: dict[str, Any] = {
            "name": "main",
            "image": self.graph.kubernetes.image,
            "command": self._argv(proc),
            "env": self._env(proc, comp),
            **self._probes(comp, proc),
        }
        mounts = self._tls_mount()
        if isinstance(comp, Frontend):
            container["ports"] = [{"name": "http", "containerPort": comp.http.port}]
            if comp.auth.keys_file is not None:
                mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
        else:
            container["ports"] = [{"name": "request-plane", "containerPort": WORKER_PORT}]
            argv = container["command"]
            if "--metrics-port" in argv:
                port = int(argv[argv.index("--metrics-port") + 1])
                container["ports"].append({"name": "metrics", "containerPort": port})
            if proc.group and proc.rank == 0:
                container["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT})
            if comp.gpus.per_replica:
                gpus = {"nvidia.com/gpu": str(comp.gpus_per_node)}  # a pod is a node's share
                container["resources"] = {"limits": gpus, "requests": gpus}
            if self.volume:
                mounts.append(models_mount(self.graph))
        if self.files and isinstance(comp, Worker):
            mounts.append({"name": "files", "mountPath": FILES_DIR, "readOnly": True})
        if mounts:
            container["volumeMounts"] = mounts
        return container

    def _pod(self, key: str, comp: Frontend | Worker, proc: ProcessSpec) -> dict[str, Any]:
        volumes = self._tls_volume()
        if isinstance(comp, Frontend) and comp.auth.keys_file is not None:
            items = [{"key": f"{key}-keys.yaml", "path": "keys.yaml"}]
            volumes.append(
                {"name": "keys", "secret": {"secretName": secret_name(self.graph), "items": items}}
            )
        if isinstance(comp, Worker):
            if self.volume:
                volumes.append(models_volume(self.graph))
            if self.files:
                volumes.append({"name": "files", "configMap": {"name": f"{self.base}-files"}})
        pod: dict[str, Any] = {
            **pod_defaults(self.graph),
            "containers": [self._container(comp, proc)],
            "terminationGracePeriodSeconds": math.ceil(comp.shutdown_grace_s),
        }
        if volumes:
            pod["volumes"] = volumes
        return pod

    def _deployment(self, key: str, comp: Frontend | Worker, proc: ProcessSpec) -> dict[str, Any]:
        labels = {PART_OF: self.base, COMPONENT: self.names[key]}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": metadata(self.graph, f"{self.base}-{self.names[key]}", self.names[key]),
            "spec": {
                "replicas": comp.replicas,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": self._pod(key, comp, proc)},
            },
        }

    def _leader_worker_set(self, key: str, worker: Worker, leader: ProcessSpec) -> dict[str, Any]:
        """A worker whose replicas span nodes: a LeaderWorkerSet, one group of `nodes` pods per
        replica (the leader's pod runs rank 0, the others ranks 1.. by LWS_WORKER_INDEX), which
        is recreated as a whole when one of its pods restarts, as the supervisor does."""
        labels = {PART_OF: self.base, COMPONENT: self.names[key]}
        follower = next(
            (p for p in self.plan.processes if p.group == leader.group and p.rank == 1),
            None,
        ) or self._scaled_to_zero(key, rank=1)
        return {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": metadata(self.graph, f"{self.base}-{self.names[key]}", self.names[key]),
            "spec": {
                "replicas": worker.replicas,
                "leaderWorkerTemplate": {
                    "size": worker.nodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {
                        "metadata": {"labels": labels},
                        "spec": self._pod(key, worker, leader),
                    },
                    "workerTemplate": {
                        "metadata": {"labels": labels},
                        "spec": self._pod(key, worker, follower),
                    },
                },
            },
        }

    def _service(
        self, name: str, component: str, ports: dict[str, int], headless: bool = False
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "selector": {PART_OF: self.base, COMPONENT: component},
            "ports": [{"name": n, "port": p, "targetPort": n} for n, p in sorted(ports.items())],
        }
        if headless:
            spec["clusterIP"] = "None"
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata(self.graph, name, component),
            "spec": spec,
        }

    def _stateful(
        self, component: str, image: str, command: list[str], ports: dict[str, int]
    ) -> dict[str, Any]:
        name = f"{self.base}-{component}"
        labels = {PART_OF: self.base, COMPONENT: component}
        container = {
            "name": component,
            "image": image,
            "command": command,
            "ports": [{"name": n, "containerPort": p} for n, p in sorted(ports.items())],
            "readinessProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 2},
            "volumeMounts": [{"name": "data", "mountPath": "/data"}, *self._tls_mount()],
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": metadata(self.graph, name, component),
            "spec": {
                "serviceName": name,
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        **pod_defaults(self.graph),
                        "containers": [container],
                        # Leases and subjects live as long as the graph's processes: no claim needed.
                        "volumes": [{"name": "data", "emptyDir": {}}, *self._tls_volume()],
                    },
                },
            },
        }

    def _infra(self) -> list[dict[str, Any]]:
        docs = []
        scheme = "https" if self.tls else "http"
        cert, key, ca = f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt"
        if self.etcd:
            url = f"{scheme}://{self.base}-etcd:{ETCD_PORT}"
            peer = f"{scheme}://{self.base}-etcd-0.{self.base}-etcd:{ETCD_PEER_PORT}"
            command = [
                "etcd", "--name", f"{self.base}-etcd-0", "--data-dir", "/data",
                "--listen-client-urls", f"{scheme}://0.0.0.0:{ETCD_PORT}", "--advertise-client-urls", url,
                "--listen-peer-urls", f"{scheme}://0.0.0.0:{ETCD_PEER_PORT}",
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"{self.base}-etcd-0={peer}",
                "--initial-cluster-state", "new",
            ]  # fmt: skip
            for side in ("", "peer-") if self.tls else ():
                command += [f"--{side}cert-file", cert, f"--{side}key-file", key]
                command += [f"--{side}trusted-ca-file", ca, f"--{side}client-cert-auth"]
            ports = {"client": ETCD_PORT, "peer": ETCD_PEER_PORT}
            docs += [
                self._stateful("etcd", ETCD_IMAGE, command, ports),
                self._service(f"{self.base}-etcd", "etcd", ports, headless=True),
            ]
        if self.nats:
            nats = self.graph.infra.nats
            command = ["nats-server", "-p", str(NATS_PORT)] + (
                ["-js", "-sd", "/data"] if nats and nats.jetstream else []
            )
            if self.tls:
                command += ["--tls", "--tlscert", cert, "--tlskey", key, "--tlscacert", ca, "--tlsverify"]
            ports = {"client": NATS_PORT}
            docs += [
                self._stateful("nats", NATS_IMAGE, command, ports),
                self._service(f"{self.base}-nats", "nats", ports, headless=True),
            ]
        return docs

    def _claim(self) -> list[dict[str, Any]]:
        storage = self.graph.kubernetes.models
        if not self.volume or storage.claim is not None or storage.host_path is not None:
            return []
        spec: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": storage.size}},
        }
        if storage.storage_class:
            spec["storageClassName"] = storage.storage_class
        return [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": metadata(self.graph, models_claim(self.graph)),
                "spec": spec,
            }
        ]

    def documents(self) -> list[dict[str, Any]]:
        self._map_paths()
        first = {p.component: p for p in reversed(self.plan.processes)}  # replica 0 of each
        docs: list[dict[str, Any]] = []
        for key, comp in sorted(self.graph.components.items()):
            if isinstance(comp, Worker) and key not in first:  # replicas: 0
                first[key] = self._scaled_to_zero(key)
            if isinstance(comp, Worker) and comp.nodes > 1:
                docs.append(self._leader_worker_set(key, comp, first[key]))
            else:
                docs.append(self._deployment(key, comp, first[key]))
            if isinstance(comp, Frontend):
                name = f"{self.base}-{self.names[key]}"
                docs.append(self._service(name, self.names[key], {"http": comp.http.port}))
        if self.files:
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": metadata(self.graph, f"{self.base}-files"),
                    "data": dict(sorted(self.files.items())),
                }
            )
        return self._infra() + self._claim() + docs

    def _scaled_to_zero(self, key: str, rank: int = 0) -> ProcessSpec:
        """A worker with `replicas: 0` has no process in the plan; compile one to get its command
        (that of its rank `rank`)."""
        graph = self.graph.model_copy(deep=True)
        worker = graph.components[key]
        assert isinstance(worker, Worker)
        worker.replicas = 1
        plan = compile_graph(
            graph, graph_file=Path(self.plan.graph_file), state_dir=Path(self.plan.state_dir)
        )
        return next(p for p in plan.processes if p.component == key and p.rank == rank)


def render_k8s(graph: Graph, plan: Plan) -> str:
    k8s = _K8s(graph, plan)
    docs = k8s.documents()
    header = [
        f"Kubernetes manifests of graph {graph.name!r}, rendered by dyngraph (kubectl apply -f).",
        f"Secret values come from the Secret {secret_name(graph)!r} (a key per variable), not rendered here.",
    ]
    if k8s.notes:
        header += ["Changed or left out for the cluster:", *[f"  {n}" for n in k8s.notes]]
    return dump_documents(docs, header)
