"""`render -f k8s`: plain Kubernetes manifests that run a graph's compiled plan.

Every object is validated against Kubernetes' own OpenAPI schemas, strictly
(tests/support/kube_schemas.py: kubernetes-validate, pinned, Kubernetes K8S_VERSION).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dynamo_graph.graph.build import build
from dynamo_graph.graph.targets.dispatch import render
from tests.support.engine_adapters import sglang_pd_worker
from tests.support.kube_schemas import k8s_errors

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "fixtures" / "snapshots"
SHIPPED = sorted(p for p in (ROOT / "graphs").rglob("*.yaml") if ".dyngraph" not in p.parts)


def _docs(path: Path, overrides: list[str] = ()) -> list[dict]:
    built = build(path, overrides)
    return list(yaml.safe_load_all(render(built.graph, built.plan, "k8s")))


def _by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _write(tmp_path: Path, graph: dict) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(graph))
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_graph_renders_strictly_valid_manifests(path: Path) -> None:
    docs = _docs(path)
    assert [e for d in docs for e in k8s_errors(d)] == []
    assert "{port:" not in yaml.safe_dump_all(docs)  # ports `up` gives out per host: none in a pod
    built = build(path)
    objects = _by_kind(docs)
    base = built.graph.name
    for key, worker in built.graph.workers().items():
        deployment = objects["Deployment", f"{base}-{key}"]
        assert deployment["spec"]["replicas"] == worker.replicas
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][:4] == [
            "dyngraph",
            "run",
            f"in={worker.endpoint_name()}",
            f"out={worker.engine}",
        ]
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (str(worker.gpus.per_replica) if worker.gpus.per_replica else None)
    for key, frontend in built.graph.frontends().items():
        assert objects["Service", f"{base}-{key}"]["spec"]["ports"][0]["port"] == frontend.http.port
        container = objects["Deployment", f"{base}-{key}"]["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][container["command"].index("--http-host") + 1] == "0.0.0.0"
        assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    # Discovery spans pods through etcd: in the cluster unless the graph points at one.
    if built.graph.runtime.discovery == "file" or built.graph.infra.etcd.managed:
        assert ("StatefulSet", f"{base}-etcd") in objects and ("Service", f"{base}-etcd") in objects


def test_the_validator_is_strict() -> None:
    docs = _docs(ROOT / "graphs" / "ci" / "echo.yaml")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["entrypoint"] = ["x"]
    assert k8s_errors(deployment)
    deployment["spec"]["template"]["spec"]["containers"][0].pop("entrypoint")
    deployment["spec"]["replicas"] = "two"
    assert k8s_errors(deployment)


@pytest.mark.parametrize(
    "name", ["ci/mocker-disagg.yaml", "ci/echo-etcd-nats.yaml", "templates/multi-host.yaml"]
)
def test_k8s_snapshots(name: str) -> None:
    """Output is deterministic and reviewed: UPDATE_SNAPSHOTS=1 rewrites the files."""
    built = build(ROOT / "graphs" / name)
    text = render(built.graph, built.plan, "k8s")
    snapshot = SNAPSHOTS / ("k8s-" + name.replace("/", "-"))
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snapshot.write_text(text)
    assert text == snapshot.read_text()


def test_workers_get_files_models_and_in_cluster_planes(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "args.json").write_text('{"speedup_ratio": 5.0}\n')
    (tmp_path / "my_engine.py").write_text("ENGINE = 1\n")
    graph = {
        "name": "Files_Graph",
        "runtime": {"discovery": "etcd", "request_plane": "nats", "event_plane": "nats"},
        "infra": {"etcd": {"endpoints": ["http://etcd.example:2379"]}, "nats": {"managed": True}},
        "hosts": {"local": {"gpus": 4}},
        "models": {"m": {"path": "model"}},
        "kubernetes": {
            "namespace": "serving",
            "image_pull_secrets": ["regcred"],
            "service_account": "dyngraph",
            "models": {"host_path": "/data/models"},
        },
        "components": {
            "web": {"kind": "frontend", "replicas": 3},
            "sim": {"kind": "worker", "model": "m", "engine": "mocker", "engine_args_file": "args.json"},
            "py": {"kind": "worker", "model": "m", "engine": "my_engine.py", "replicas": 0,
                   "gpus": {"per_replica": 2, "tensor_parallel_size": 2}},
        },
    }  # fmt: skip
    docs = _docs(_write(tmp_path, graph))
    assert [e for d in docs for e in k8s_errors(d)] == []
    objects = _by_kind(docs)
    assert all(d["metadata"]["namespace"] == "serving" for d in docs)
    files = objects["ConfigMap", "files-graph-files"]["data"]
    assert files == {"sim.json": '{"speedup_ratio": 5.0}\n', "py.py": "ENGINE = 1\n"}
    py = objects["Deployment", "files-graph-py"]
    assert py["spec"]["replicas"] == 0
    web = objects["Deployment", "files-graph-web"]  # a frontend's replicas are pods, each alone
    assert web["spec"]["replicas"] == 3
    assert "DYN_FRONTEND_GROUP" not in {
        e["name"] for e in web["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    pod = py["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["serviceAccountName"] == "dyngraph"
    assert {"name": "models", "hostPath": {"path": "/data/models", "type": "Directory"}} in pod["volumes"]
    command = pod["containers"][0]["command"]
    assert "out=/etc/dyngraph/py.py" in command and "--tensor-parallel-size" in command
    assert command[command.index("--model-path") + 1] == "/models/model"
    sim = objects["Deployment", "files-graph-sim"]["spec"]["template"]["spec"]["containers"][0]
    assert sim["command"][sim["command"].index("--extra-engine-args") + 1] == "/etc/dyngraph/sim.json"
    env = {e["name"]: e.get("value") for e in sim["env"]}
    assert env["ETCD_ENDPOINTS"] == "http://etcd.example:2379"  # the graph's own etcd
    assert env["NATS_SERVER"] == "nats://files-graph-nats:4222"  # managed: in the cluster
    assert "readinessProbe" not in sim  # nats request plane: no port to probe
    assert ("StatefulSet", "files-graph-nats") in objects and (
        "StatefulSet",
        "files-graph-etcd",
    ) not in objects
    assert ("PersistentVolumeClaim", "files-graph-models") not in objects  # host_path instead


def test_secret_values_never_appear_in_any_rendered_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, key, password = "hf_s3cr3t_t0k3n_value", "sk-live-0123456789abcdef", "n4ts-p4ssw0rd"
    monkeypatch.setenv("MY_HF_TOKEN", token)
    monkeypatch.setenv("MY_API_KEY", key)
    monkeypatch.setenv("NATS_PASSWORD", password)
    graph = {
        "name": "secrets",
        "runtime": {"request_plane": "nats"},
        "infra": {"nats": {"url": "nats://svc:${env:NATS_PASSWORD}@nats.example:4222"}},
        "models": {"m": {"path": "org/m"}},
        "components": {
            "frontend": {"kind": "frontend", "api_key_env": ["MY_API_KEY"],
                         "env": {"SERVICE_KEY": "${env:MY_API_KEY}"}},
            "backend": {"kind": "worker", "model": "m", "engine": "mocker",
                        "env": {"HF_TOKEN": "${env:MY_HF_TOKEN}", "DYN_LOG": "info"}},
        },
    }  # fmt: skip
    path = _write(tmp_path, graph)
    built = build(path)
    assert built.graph.components["backend"].env["HF_TOKEN"] == token  # the loader did read it
    for fmt in ("k8s", "dynamo-k8s", "yaml", "json", "shell"):
        text = render(built.graph, built.plan, fmt)
        for secret in (token, key, password):
            assert secret not in text, (fmt, secret)
    docs = _by_kind(_docs(path))
    env = {
        e["name"]: e
        for e in docs["Deployment", "secrets-backend"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "secrets-secrets", "key": "HF_TOKEN"}},
    }
    assert "secretKeyRef" in env["NATS_SERVER"]["valueFrom"]  # a URL with credentials
    assert env["DYN_LOG"] == {"name": "DYN_LOG", "value": "info"}
    front = {
        e["name"]: e
        for e in docs["Deployment", "secrets-frontend"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert front["MY_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "MY_API_KEY"
    assert front["DYN_API_KEY_ENV"]["value"] == "MY_API_KEY"
    dgd = yaml.safe_load(
        render(build(path, engines="dynamo").graph, built.plan, "dynamo-k8s").split("---\n", 1)[1]
    )
    dgd_env = {e["name"]: e for e in dgd["spec"]["services"]["backend"]["envs"]}
    assert dgd_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "secrets-secrets", "key": "HF_TOKEN"}


def test_a_keys_file_is_mounted_from_the_graph_s_secret_never_rendered(tmp_path: Path) -> None:
    digest = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"
    (tmp_path / "keys.yaml").write_text(f"keys:\n  - name: team\n    key_sha256: {digest}\n")
    graph = {
        "name": "tenants",
        "models": {"m": {"path": "org/m"}},
        "components": {
            "frontend": {"kind": "frontend", "auth": {"keys_file": "keys.yaml"}},
            "backend": {"kind": "worker", "model": "m", "engine": "mocker"},
        },
    }
    path = _write(tmp_path, graph)
    built = build(path)
    for fmt in ("k8s", "dynamo-k8s", "yaml", "json", "shell"):
        assert digest not in render(built.graph, built.plan, fmt), fmt
    docs = _by_kind(_docs(path))
    assert all(not k8s_errors(doc) for doc in docs.values())
    pod = docs["Deployment", "tenants-frontend"]["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("--api-keys-file") + 1] == "/etc/dyngraph-keys/keys.yaml"
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "keys", "mountPath": "/etc/dyngraph-keys", "readOnly": True}
    ]
    assert pod["volumes"] == [
        {
            "name": "keys",
            "secret": {
                "secretName": "tenants-secrets",
                "items": [{"key": "frontend-keys.yaml", "path": "keys.yaml"}],
            },
        }
    ]


def test_static_workers_are_refused(tmp_path: Path) -> None:
    graph = {
        "name": "static",
        "models": {"m": {"path": "org/m"}},
        "components": {
            "w": {"kind": "worker", "model": "m", "engine": "echo_core", "static": True, "tcp_port": 9000}
        },
    }
    built = build(_write(tmp_path, graph))
    with pytest.raises(Exception, match="static workers are not rendered"):
        render(built.graph, built.plan, "k8s")


def test_lora_adapters_are_found_on_the_models_volume(tmp_path: Path) -> None:
    """A graph's LoRA adapters (local folders) sit on the models volume under their own names,
    like the model, and the worker's --lora-modules names them there."""
    for name in ("base-model", "sql-adapter"):
        (tmp_path / name).mkdir()
    graph = {
        "name": "lora",
        "models": {"m": {"path": "./base-model", "lora_adapters": {"sql": "./sql-adapter"}}},
        "components": {
            "frontend": {"kind": "frontend"},
            "backend": {"kind": "worker", "model": "m", "engine": "mocker"},
        },
    }
    docs = _docs(_write(tmp_path, graph))
    assert [e for d in docs for e in k8s_errors(d)] == []
    pod = _by_kind(docs)["Deployment", "lora-backend"]["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    mount = pod["containers"][0]["volumeMounts"][0]["mountPath"]
    assert command[command.index("--model-path") + 1] == f"{mount}/base-model"
    assert command[command.index("--lora-modules") + 1] == f"sql={mount}/sql-adapter"
    assert str(tmp_path) not in yaml.safe_dump(pod)


def test_sglang_prefill_pods_serve_their_bootstrap_on_their_own_ip(tmp_path: Path) -> None:
    """Locally each SGLang prefill process gets a port of its own (`{port:...}`); a pod has its
    network to itself, so it keeps SGLang's default port and publishes its pod IP."""
    graph = {
        "name": "pd",
        "models": {"m": {"path": "org/m"}},
        "components": {
            "web": {"kind": "frontend"},
            "pre": sglang_pd_worker("m", "prefill", replicas=2),
            "dec": sglang_pd_worker("m", "decode"),
        },
    }
    docs = _docs(_write(tmp_path, graph))
    assert [e for d in docs for e in k8s_errors(d)] == []
    assert "{port:" not in yaml.safe_dump_all(docs)
    objects = _by_kind(docs)
    pre = objects["Deployment", "pd-pre"]["spec"]["template"]["spec"]["containers"][0]
    assert "--disaggregation-bootstrap-port" not in pre["command"]
    host = next(e for e in pre["env"] if e["name"] == "SGLANG_HOST_IP")
    assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    dec = objects["Deployment", "pd-dec"]["spec"]["template"]["spec"]["containers"][0]
    assert "SGLANG_HOST_IP" not in {e["name"] for e in dec["env"]}
