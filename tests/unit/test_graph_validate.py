"""Graph validation: each invalid graph gives the expected key path and message, all at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dynamo_graph.graph.errors import GraphError, Location, Problem
from dynamo_graph.graph.validate import validate_graph
from tests.support.graph_problems import FILE, HEAD, MINIMAL, YamlLines, problems, valid

REPO = Path(__file__).resolve().parents[2]

INVALID = [
    (
        "typo-did-you-mean",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core, replcas: 2}\n",
        "components.backend.replcas",
        "unknown key 'replcas'; did you mean 'replicas'?",
    ),
    (
        "top-level-typo",
        HEAD + "componets: {}\n",
        "componets",
        "did you mean 'components'?",
    ),
    (
        "wrong-type",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core, replicas: many}\n",
        "components.backend.replicas",
        "expected an integer, got 'many'",
    ),
    (
        "negative-replicas",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core, replicas: -1}\n",
        "components.backend.replicas",
        "must be >= 0, got -1",
    ),
    (
        "unknown-engine",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: vlm}\n",
        "components.backend.engine",
        "unknown engine 'vlm'",
    ),
    (
        "unknown-kind",
        HEAD + "components:\n  backend: {kind: wroker, model: tiny, engine: echo_core}\n",
        "components.backend.kind",
        "did you mean 'worker'?",
    ),
    (
        "autoscale-min-above-max",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core,"
        " autoscale: {min_replicas: 3, max_replicas: 2, target: {ttft_p90_ms: 500}}}\n",
        "components.backend.autoscale.min_replicas",
        "must be at most `max_replicas` (2)",
    ),
    (
        "autoscale-replicas-outside-bounds",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core, replicas: 5,"
        " autoscale: {max_replicas: 4, target: {ttft_p90_ms: 500}}}\n",
        "components.backend.replicas",
        "must be within autoscale's 1..4",
    ),
    (
        "autoscale-needs-a-target",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core,"
        " autoscale: {max_replicas: 4, target: {}}}\n",
        "components.backend.autoscale.target.ttft_p90_ms",
        "give at least one of `ttft_p90_ms`, `itl_p90_ms`, `kv_usage`",
    ),
    (
        "canary-steps-must-end-at-100",
        HEAD + "rollout: {strategy: canary, steps: [10, 50]}\n"
        "components:\n  backend: {kind: worker, model: tiny, engine: echo_core}\n",
        "rollout.steps",
        "must end at 100",
    ),
    (
        "canary-steps-must-ascend",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core,"
        " rollout: {strategy: canary, steps: [50, 10, 100]}}\n",
        "components.backend.rollout.steps",
        "must ascend",
    ),
    (
        "no-canary-frontend",
        HEAD + "components:\n  frontend: {kind: frontend, rollout: {strategy: canary}}\n"
        "  backend: {kind: worker, model: tiny, engine: echo_core}\n",
        "components.frontend.rollout.strategy",
        "requests cannot be split between revisions",
    ),
    (
        "bad-plane",
        MINIMAL + "runtime: {request_plane: nat}\n",
        "runtime.request_plane",
        "'nat' is not one of tcp, nats; did you mean 'nats'?",
    ),
    (
        "dangling-model",
        HEAD + "components:\n  backend: {kind: worker, model: tiyn, engine: echo_core}\n",
        "components.backend.model",
        "no model named 'tiyn'; did you mean 'tiny'?",
    ),
    (
        "dangling-host",
        HEAD
        + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core,"
        + " placement: [local, gpu9]}\n",
        "components.backend.placement.1",
        "no host named 'gpu9'",
    ),
    (
        "dangling-depends-on",
        MINIMAL + "    depends_on: [frontnd]\n",
        "components.backend.depends_on.0",
        "no component named 'frontnd'; did you mean 'frontend'?",
    ),
    (
        "cycle",
        HEAD
        + """\
components:
  a: {kind: worker, model: tiny, engine: echo_core, depends_on: [b]}
  b: {kind: worker, model: tiny, engine: echo_core, depends_on: [c]}
  c: {kind: worker, model: tiny, engine: echo_core, depends_on: [a]}
""",
        "components.c.depends_on",
        "dependency cycle: a -> b -> c -> a",
    ),
    (
        "http-port-clash",
        MINIMAL + "  frontend2: {kind: frontend, http: {host: 0.0.0.0}}\n",
        "components.frontend2.http.port",
        "port 8080 on host 'local' is already used by components.frontend.http.port",
    ),
    (
        "infra-port-clash",
        MINIMAL
        + "runtime: {discovery: etcd}\ninfra:\n  etcd: {managed: true, client_port: 2379, peer_port: 8080}\n",
        "components.frontend.http.port",
        "port 8080 on host 'local' is already used by infra.etcd.peer_port",
    ),
    (
        "gpu-oversubscription",
        HEAD
        + """\
hosts:
  local: {gpus: 2}
components:
  backend:
    kind: worker
    model: tiny
    engine: vllm
    replicas: 3
    gpus: {per_replica: 1}
""",
        "components.backend.gpus.per_replica",
        "asks for 3 GPU(s) on host 'local', which has 2",
    ),
    (
        "gpus-on-local-undeclared",
        HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: vllm, gpus: {per_replica: 1}}\n",
        "components.backend.gpus.per_replica",
        "set hosts.local.gpus",
    ),
    (
        "gpu-id-out-of-range",
        HEAD
        + "hosts: {local: {gpus: 2}}\n"
        + "components:\n  backend: {kind: worker, model: tiny, engine: vllm,"
        + " gpus: {per_replica: 1, gpu_ids: [3]}}\n",
        "components.backend.gpus.gpu_ids",
        "has 2 GPU(s); no GPU 3 there",
    ),
    (
        "disagg-without-decode",
        HEAD + "components:\n  prefill: {kind: worker, model: tiny, engine: mocker, role: prefill}\n",
        "components.prefill.role",
        "model 'tiny' has a prefill worker but no decode worker",
    ),
    (
        "disagg-engine-without-kv-transfer",
        HEAD
        + "components:\n  prefill: {kind: worker, model: tiny, engine: echo_core, role: prefill}\n"
        + "  decode: {kind: worker, model: tiny, engine: mocker, role: decode}\n",
        "components.prefill.engine",
        "role prefill needs an engine that hands the prompt's KV cache",
    ),
    (
        "disagg-vllm-without-kv-connector",
        HEAD
        + "components:\n  prefill: {kind: worker, model: tiny, engine: vllm, role: prefill,"
        + " engine_args: {kv_transfer_config: {kv_role: kv_producer}}}\n"
        + "  decode: {kind: worker, model: tiny, engine: mocker, role: decode}\n",
        "components.prefill.engine_args",
        "vllm moves the KV cache with its own connector; add kv_transfer_config with a kv_connector",
    ),
    (
        "disagg-trtllm-without-cache-transceiver",
        HEAD
        + "components:\n  prefill: {kind: worker, model: tiny, engine: mocker, role: prefill}\n"
        + "  decode: {kind: worker, model: tiny, engine: trtllm, role: decode}\n",
        "components.decode.engine_args",
        "add cache_transceiver_config to engine_args",
    ),
    (
        "disagg-sglang-without-transfer-backend",
        HEAD
        + "components:\n  prefill: {kind: worker, model: tiny, engine: sglang, role: prefill,"
        + " engine_args: {disaggregation_transfer_backend: nixl}}\n"
        + "  decode: {kind: worker, model: tiny, engine: sglang, role: decode}\n",
        "components.decode.engine_args",
        "sglang moves the KV cache with its own connector; add disaggregation_transfer_backend",
    ),
    (
        "conditional-disagg-on-sglang-decode",
        HEAD
        + "components:\n  front: {kind: frontend, disagg: {conditional: true}}\n"
        + "  prefill: {kind: worker, model: tiny, engine: sglang, role: prefill,"
        + " engine_args: {disaggregation_transfer_backend: nixl}}\n"
        + "  decode: {kind: worker, model: tiny, engine: sglang, role: decode,"
        + " engine_args: {disaggregation_transfer_backend: nixl}}\n",
        "components.front.disagg.conditional",
        "and decode cannot (sglang's decode engine only continues from a prefill worker's KV)",
    ),
    (
        "kv-router-without-events",
        MINIMAL.replace("kind: frontend", "kind: frontend\n    router: {mode: kv}"),
        "components.frontend.router.mode",
        "worker 'backend' (engine echo_core) publishes none",
    ),
    (
        "kv-router-inproc-events",
        MINIMAL.replace("kind: frontend", "kind: frontend\n    router: {mode: kv}").replace(
            "echo_core", "mocker"
        )
        + "runtime: {event_plane: inproc}\n",
        "runtime.event_plane",
        "`inproc` cannot carry between processes",
    ),
    (
        "multi-host-file-discovery",
        MINIMAL
        + "    placement: [gpu1]\n"
        + "runtime: {request_plane: nats}\ninfra: {nats: {url: 'nats://10.0.0.1:4222'}}\n"
        + "hosts:\n  gpu1: {ssh: {address: 10.0.0.2}}\n",
        "runtime.discovery",
        "use `discovery: etcd`",
    ),
    (
        "multi-host-tcp-without-advertise",
        MINIMAL
        + "    placement: [local, gpu1]\n"
        + "runtime: {discovery: etcd}\ninfra: {etcd: {endpoints: ['http://10.0.0.1:2379']}}\n"
        + "hosts:\n  gpu1: {ssh: {address: 10.0.0.2}}\n",
        "hosts.local.advertise_host",
        "the tcp request plane needs the address other hosts reach 'local' at",
    ),
    (
        "multi-host-zmq-kv-events-without-advertise",
        MINIMAL.replace("kind: frontend", "kind: frontend\n    router: {mode: kv}").replace(
            "echo_core", "mocker"
        )
        + "    placement: [local, gpu1]\n"
        + "runtime: {discovery: etcd, request_plane: nats, event_plane: zmq}\n"
        + "infra: {etcd: {endpoints: ['http://10.0.0.1:2379']}, nats: {url: 'nats://10.0.0.1:4222'}}\n"
        + "hosts:\n  gpu1: {ssh: {address: 10.0.0.2}}\n",
        "hosts.local.advertise_host",
        "KV events over zmq (components.frontend routes by them) needs the address other hosts reach 'local'",
    ),
    (
        "multi-host-loopback-etcd",
        MINIMAL
        + "    placement: [gpu1]\n"
        + "runtime: {discovery: etcd}\ninfra: {etcd: {endpoints: ['http://127.0.0.1:2379']}}\n"
        + "hosts:\n  gpu1: {ssh: {address: 10.0.0.2}}\n",
        "infra.etcd.endpoints.0",
        "cannot reach http://127.0.0.1:2379",
    ),
    (
        "nats-plane-without-infra",
        MINIMAL + "runtime: {request_plane: nats}\n",
        "runtime.request_plane",
        "the nats plane needs infra.nats",
    ),
    (
        "etcd-without-infra",
        MINIMAL + "runtime: {discovery: etcd}\n",
        "runtime.discovery",
        "etcd discovery needs infra.etcd",
    ),
    (
        "infra-neither-managed-nor-external",
        MINIMAL + "runtime: {discovery: etcd}\ninfra: {etcd: {}}\n",
        "infra.etcd.managed",
        "set `managed: true` or give `endpoints`",
    ),
    (
        "literal-api-key",
        MINIMAL.replace("kind: frontend", "kind: frontend\n    api_key_env: [OK_KEY, sk-live-12345]"),
        "components.frontend.api_key_env.1",
        "never a literal key",
    ),
    (
        "duplicate-served-name",
        MINIMAL + "  other: {kind: worker, model: tiny2, engine: echo_core}\n"
        "models:\n  tiny: {path: ./tiny}\n  tiny2: {path: ./tiny2, name: tiny}\n",
        "models.tiny2.name",
        "served name 'tiny' is already used by models.tiny",
    ),
    (
        "duplicate-endpoint",
        MINIMAL + "  other: {kind: worker, model: tiny, engine: echo_core, endpoint: backend.generate}\n",
        "components.other.endpoint",
        "dyn://demo.backend.generate is already the endpoint of components.backend",
    ),
    (
        "bad-endpoint",
        MINIMAL + "    endpoint: dyn://a.b.c.d\n",
        "components.backend.endpoint",
        "at most three parts",
    ),
    (
        "namespace-without-scheme",
        MINIMAL + "    endpoint: ns.comp.ep\n",
        "components.backend.endpoint",
        "write `dyn://ns.comp.ep`",
    ),
    (
        "engine-args-twice",
        MINIMAL + "    engine_args: {max_num_seqs: 8}\n    engine_args_file: args.json\n",
        "components.backend.engine_args_file",
        "give either `engine_args` or `engine_args_file`, not both",
    ),
    (
        "extra-key-in-ssh",
        MINIMAL + "hosts:\n  gpu1:\n    ssh: {address: 10.0.0.2, prot: 2222}\n",
        "hosts.gpu1.ssh.prot",
        "unknown key 'prot'; did you mean 'port'?",
    ),
    (
        "remote-host-without-ssh",
        MINIMAL + "hosts:\n  gpu1: {gpus: 8}\n",
        "hosts.gpu1.ssh",
        "needs `ssh: {address: ...}`",
    ),
    (
        "static-without-port",
        MINIMAL + "    static: true\n",
        "components.backend.static",
        "needs a fixed `tcp_port`",
    ),
    (
        "bad-env-name",
        MINIMAL + "    env: {BAD-NAME: 1}\n",
        "components.backend.env.BAD-NAME",
        "invalid name: 'BAD-NAME' is not an environment variable name",
    ),
    (
        "missing-required",
        HEAD + "components:\n  backend: {kind: worker, model: tiny}\n",
        "components.backend.engine",
        "required key is missing",
    ),
    (
        "tp-larger-than-gpus",
        MINIMAL + "    gpus: {per_replica: 1, tensor_parallel_size: 2}\n",
        "components.backend.gpus.per_replica",
        "tensor_parallel_size 2 needs at least that many GPUs per replica",
    ),
]


@pytest.mark.parametrize(("graph", "path", "fragment"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_graph(graph: str, path: str, fragment: str) -> None:
    found = problems(graph)
    assert [p.path for p in found] == [path], found
    assert fragment in found[0].message
    assert found[0].location is not None and found[0].location.file == FILE


def test_literal_api_key_is_never_echoed() -> None:
    found = problems(MINIMAL.replace("kind: frontend", "kind: frontend\n    api_key_env: [sk-live-12345]"))
    assert all("sk-live" not in str(p) for p in found)


@pytest.mark.parametrize(
    ("graph", "path", "line"),
    [
        (MINIMAL + "    replcas: 2\n", "components.backend.replcas", 11),
        (MINIMAL + "    gpus:\n      per_replica: 1\n", "components.backend.gpus.per_replica", 12),
        (
            MINIMAL.replace("kind: frontend", "kind: frontend\n    router: {mode: kv}"),
            "components.frontend.router.mode",
            7,
        ),
        # The key is not in the file: the nearest parent that is.
        (
            MINIMAL
            + "    placement: [local, gpu1]\n"
            + "runtime: {discovery: etcd}\ninfra: {etcd: {endpoints: ['http://10.0.0.1:2379']}}\n"
            + "hosts:\n  gpu1: {ssh: {address: 10.0.0.2}}\n",
            "hosts.local.advertise_host",
            14,
        ),
        (MINIMAL + "runtime: {discovery: etcd}\n", "runtime.discovery", 11),
    ],
)
def test_problem_lines(graph: str, path: str, line: int) -> None:
    (problem,) = problems(graph)
    assert problem.path == path
    assert problem.location == Location(FILE, line)
    assert str(problem).startswith(f"{FILE}:{line}: {path}: ")


def test_without_source_the_file_is_the_location() -> None:
    with pytest.raises(GraphError) as info:
        validate_graph({"name": "x", "nmae": "y"}, None, file="g.yaml")
    (problem,) = info.value.problems
    assert str(problem) == "g.yaml: nmae: unknown key 'nmae'; did you mean 'name'?"


def test_not_a_mapping() -> None:
    with pytest.raises(GraphError) as info:
        validate_graph(["name"], None, file="g.yaml")
    assert info.value.problems == [
        Problem("", "expected a mapping (key: value), got a list", Location("g.yaml"))
    ]


def test_several_schema_problems_at_once() -> None:
    found = problems(
        HEAD
        + """\
components:
  backend: {kind: worker, model: tiny, engine: vlm, replicas: -1}
  frontend: {kind: frontend, htpp: {port: 8080}}
"""
    )
    assert sorted(p.path for p in found) == [
        "components.backend.engine",
        "components.backend.replicas",
        "components.frontend.htpp",
    ]


def test_several_semantic_problems_at_once() -> None:
    found = problems(
        MINIMAL
        + """\
    depends_on: [nothing]
  decode: {kind: worker, model: tiny, engine: mocker, role: decode}
  frontend2: {kind: frontend}
"""
    )
    assert [(p.path, p.location and p.location.line) for p in found] == [
        ("components.backend.depends_on.0", 11),
        ("components.frontend2.http.port", 13),
        ("components.decode.role", 12),
    ]


def test_minimal_graph_fills_in_defaults() -> None:
    graph = valid(MINIMAL)
    assert graph.namespace == "demo"
    assert graph.models["tiny"].name == "tiny"
    backend = graph.workers()["backend"]
    assert backend.endpoint == "dyn://demo.backend.generate"
    assert backend.placement == ["local"]
    frontend = graph.frontends()["frontend"]
    assert (frontend.http.host, frontend.http.port, frontend.router.mode) == (
        "127.0.0.1",
        8080,
        "round-robin",
    )


def test_workers_only_graph_is_valid() -> None:
    valid(HEAD + "components:\n  backend: {kind: worker, model: tiny, engine: echo_core}\n")


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("vllm", "{kv_transfer_config: {kv_connector: NixlConnector}}"),
        ("vllm", """{kv_transfer_config: '{"kv_connector": "ExampleConnector"}'}"""),
        ("trtllm", "{cache_transceiver_config: {backend: DEFAULT}}"),
        ("sglang", "{disaggregation_transfer_backend: nixl}"),
    ],
)
def test_engines_with_a_configured_kv_connector_can_disaggregate(engine: str, args: str) -> None:
    workers = "".join(
        f"  {role}: {{kind: worker, model: tiny, engine: {engine}, role: {role}, engine_args: {args}}}\n"
        for role in ("prefill", "decode")
    )
    valid(HEAD + "components:\n" + workers)


def test_kv_router_without_events_is_valid_with_use_kv_events_false() -> None:
    valid(MINIMAL.replace("kind: frontend", "kind: frontend\n    router: {mode: kv, use_kv_events: false}"))


def test_rich_graph_is_valid() -> None:
    graph = valid(
        HEAD
        + """\
namespace: prod
runtime: {discovery: etcd, request_plane: nats, event_plane: nats}
infra:
  etcd: {managed: true, client_port: 23790}
  nats: {managed: true, jetstream: true}
hosts:
  local: {gpus: 2, advertise_host: 10.0.0.1}
  gpu1:
    ssh: {address: 10.0.0.2, user: ubuntu}
    venv: /opt/dyngraph/.venv
    gpus: 8
components:
  frontend:
    kind: frontend
    http: {host: 0.0.0.0, port: 8000}
    router: {mode: kv, temperature: 0.5}
    api_key_env: [DYN_API_KEY]
    depends_on: [decode]
  prefill:
    kind: worker
    model: tiny
    engine: mocker
    role: prefill
    endpoint: prefill
    replicas: 2
    gpus: {per_replica: 1, base_gpu_id: 0}
  decode:
    kind: worker
    model: tiny
    engine: mocker
    role: decode
    endpoint: dyn://other.decode.generate
    placement: [gpu1]
    replicas: 4
    gpus: {per_replica: 2, tensor_parallel_size: 2}
    engine_args: {max_num_seqs: 64}
    restart: {policy: always, backoff_s: 0.5}
"""
    )
    assert graph.workers()["prefill"].endpoint == "dyn://prod.prefill.generate"
    assert graph.workers()["decode"].endpoint == "dyn://other.decode.generate"


def test_gpu_ids_claimed_twice() -> None:
    found = problems(
        HEAD
        + """\
hosts: {local: {gpus: 4}}
components:
  a: {kind: worker, model: tiny, engine: vllm, gpus: {per_replica: 1, gpu_ids: [1]}}
  b: {kind: worker, model: tiny, engine: vllm, gpus: {per_replica: 2, base_gpu_id: 0}}
"""
    )
    assert [(p.path, p.message) for p in found] == [
        ("components.b.gpus.base_gpu_id", "GPU 1 on host 'local' is also used by components.a")
    ]


def _plain_graph_files() -> list[Path]:
    """Shipped graphs that validate on their own: not composed by Hydra (`defaults:`) and not
    fragments under graphs/templates/, which load.py composes and its tests cover; nor a running
    graph's state (.dyngraph/), which only exists where someone ran `dyngraph up`."""
    files = []
    for path in sorted((REPO / "graphs").rglob("*.yaml")):
        parts = path.relative_to(REPO / "graphs").parts
        if "templates" in parts or ".dyngraph" in parts:
            continue
        data = yaml.safe_load(path.read_text())
        if not (isinstance(data, dict) and "defaults" in data):
            files.append(path)
    return files


@pytest.mark.parametrize("path", _plain_graph_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_graph_validates(path: Path) -> None:
    text = path.read_text()
    validate_graph(yaml.safe_load(text), YamlLines(text), file=str(path))


def test_hello_graph_is_shipped() -> None:
    assert REPO / "graphs" / "hello.yaml" in _plain_graph_files()
