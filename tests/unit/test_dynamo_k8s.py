"""`render -f dynamo-k8s` and `dyngraph import`: DynamoGraphDeployments out of graphs and back.

Every DGD is checked against the CRD's schema made strict (tests/support/kube_schemas.py): a field the
operator does not know is an error, as `kubectl apply --validate=strict` makes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.targets.dispatch import render
from dynamo_graph.graph.targets.k8s.dgd_import import (
    DgdError,
    command_line,
    import_dgd,
    import_dgd_file,
    mocker_overrides,
    parse_flags,
)
from dynamo_graph.graph.targets.k8s.dynamo_k8s import ROLE_FLAGS, build_dgd, render_dynamo_k8s
from tests.support.dgd import DGD_FILES, EXAMPLES, UPSTREAM, dgd_id
from tests.support.kube_schemas import dgd_errors

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SNAPSHOTS = FIXTURES / "snapshots"
SHIPPED = sorted(p for p in (ROOT / "graphs").rglob("*.yaml") if ".dyngraph" not in p.parts)
ECHO = {"hello.yaml", "echo.yaml", "echo-etcd-nats.yaml", "echo-tools.yaml", "agg-from-template.yaml"}
"""Shipped graphs on the echo engine, which Dynamo lacks: they render with the mocker instead."""
LLAMACPP = {"disagg-llamacpp.yaml"}
"""Shipped graphs on llama.cpp (no Dynamo backend either); their prefill follows decode's engine."""


def _overrides(path: Path) -> list[str]:
    if path.name in ECHO:
        return ["components.backend.engine=mocker"]
    return ["components.decode.engine=mocker"] if path.name in LLAMACPP else []


def _dgd(path: Path, overrides: list[str] = ()) -> dict:
    built = build(path, overrides, engines="dynamo")
    return build_dgd(built.graph, built.plan)


def _role(service: dict) -> str | None:
    """The service's prefill/decode part: its subComponentType, or its worker's flags."""
    for flag, value in parse_flags(service["extraPodSpec"]["mainContainer"].get("args", [])):
        if flag == "--disaggregation-mode" and value != "agg":
            return value
        if flag in ROLE_FLAGS:
            return ROLE_FLAGS[flag]
    return service.get("subComponentType")


def _shape(dgd: dict) -> dict[str, tuple]:
    return {
        name: (s["componentType"], s.get("subComponentType") or _role(s), s.get("replicas", 1))
        for name, s in dgd["spec"]["services"].items()
    }


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_graph_renders_a_strictly_valid_dgd(path: Path) -> None:
    dgd = _dgd(path, _overrides(path))
    assert dgd_errors(dgd) == []
    built = build(path, _overrides(path), engines="dynamo")
    assert set(_shape(dgd)) == {k.replace("_", "-") for k in built.graph.components}
    for key, worker in built.graph.workers().items():
        service = dgd["spec"]["services"][key]
        assert service["replicas"] == worker.replicas
        assert service["extraPodSpec"]["mainContainer"]["command"][:2] == ["python3", "-m"]


def test_the_strict_validator_rejects_unknown_fields_and_wrong_types() -> None:
    dgd = _dgd(ROOT / "graphs" / "ci" / "mocker-disagg.yaml")
    dgd["spec"]["services"]["decode"]["extraPodSpec"]["mainContainer"]["entrypoint"] = ["x"]
    dgd["spec"]["services"]["frontend"]["replicas"] = "one"
    errors = dgd_errors(dgd)
    assert any("'entrypoint' was unexpected" in e for e in errors)
    assert any(e.startswith("spec.services.frontend.replicas") for e in errors)


def test_echo_engines_are_an_error_naming_the_component_and_the_engines_dynamo_has() -> None:
    built = build(ROOT / "graphs" / "hello.yaml", engines="dynamo")
    with pytest.raises(GraphError) as e:
        build_dgd(built.graph, built.plan)
    (problem,) = e.value.problems
    assert problem.path == "components.backend.engine"
    assert "echo_core" in problem.message and "mocker, sglang, trtllm, vllm" in problem.message


@pytest.mark.parametrize(
    "name", ["ci/mocker-disagg.yaml", "templates/disagg.yaml", "templates/multi-host.yaml"]
)
def test_dgd_snapshots(name: str) -> None:
    """Output is deterministic and reviewed: UPDATE_SNAPSHOTS=1 rewrites the files."""
    built = build(ROOT / "graphs" / name, engines="dynamo")
    text = render(built.graph, built.plan, "dynamo-k8s")
    snapshot = SNAPSHOTS / ("dynamo-k8s-" + name.replace("/", "-"))
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snapshot.write_text(text)
    assert text == snapshot.read_text()


def test_worker_flags_per_backend(tmp_path: Path) -> None:
    graph = tmp_path / "g.yaml"
    graph.write_text(
        yaml.safe_dump(
            {
                "name": "pd",
                "hosts": {"local": {"gpus": 8}},
                "models": {"m": {"path": "org/m", "context_length": 4096, "kv_cache_block_size": 32}},
                "components": {
                    "front": {"kind": "frontend", "router": {"mode": "kv", "use_kv_events": False}},
                    "pre": {
                        "kind": "worker",
                        "model": "m",
                        "engine": "sglang",
                        "role": "prefill",
                        "gpus": {"per_replica": 2, "tensor_parallel_size": 2},
                        "engine_args": {"mem_fraction_static": 0.8, "enable_metrics": True},
                    },
                    "dec": {
                        "kind": "worker",
                        "model": "m",
                        "engine": "sglang",
                        "role": "decode",
                        "replicas": 2,
                        "gpus": {"per_replica": 1},
                    },
                },
            }
        )
    )
    dgd = _dgd(graph)
    assert dgd_errors(dgd) == []
    services = dgd["spec"]["services"]
    assert dgd["spec"]["backendFramework"] == "sglang"
    assert services["pre"]["extraPodSpec"]["mainContainer"]["args"] == [
        "--model-path", "org/m", "--served-model-name", "m", "--context-length", "4096",
        "--page-size", "32", "--tp", "2", "--skip-tokenizer-init", "--disaggregation-mode", "prefill",
        "--disaggregation-transfer-backend", "nixl", "--enable-metrics", "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    assert services["pre"]["resources"] == {"limits": {"gpu": "2"}, "requests": {"gpu": "2"}}
    assert services["dec"]["subComponentType"] == "decode" and services["dec"]["replicas"] == 2
    assert services["front"]["extraPodSpec"]["mainContainer"]["args"] == [
        "--http-port", "8080", "--router-mode", "kv", "--no-router-kv-events",
    ]  # fmt: skip
    # Hub ids only: no models volume is asked for.
    assert "volumes" not in services["pre"]["extraPodSpec"]
    # The pair is valid for Dynamo's engines, not for ours (our SGLang adapter needs its connector
    # configured, and even then cannot serve P/D through our frontend).
    with pytest.raises(GraphError, match="sglang moves the KV cache with its own connector"):
        build(graph)


# ---- import -------------------------------------------------------------------------------------


def _gpus_per_replica(service: dict) -> int:
    gpus = int(service.get("resources", {}).get("limits", {}).get("gpu", 0))
    return gpus * int(service.get("multinode", {}).get("nodeCount", 1))


@pytest.mark.parametrize("dgd", DGD_FILES, ids=[dgd_id(p) for p in DGD_FILES])
def test_dynamo_deployments_import_validate_and_render_back_to_the_same_services(
    dgd: Path, tmp_path: Path
) -> None:
    original = yaml.safe_load(dgd.read_text())
    assert dgd_errors(original) == []
    out = tmp_path / "graph.yaml"
    imported = import_dgd_file(dgd, out)
    build(out)  # valid for our engines too: Dynamo's implicit defaults are explicit now
    assert not [n for n in imported.notes if n.startswith("not runnable")]
    back = _dgd(out)
    assert dgd_errors(back) == []
    assert _shape(back) == _shape(original)
    for name, service in original["spec"]["services"].items():
        theirs, ours = service["extraPodSpec"]["mainContainer"], back["spec"]["services"][name]
        # Dynamo's frontends leave the command to the operator; ours spell it out.
        assert ours["extraPodSpec"]["mainContainer"]["command"] == theirs.get(
            "command", ["python3", "-m", "dynamo.frontend"]
        )
        assert _gpus_per_replica(ours) == _gpus_per_replica(service)
        assert ours.get("multinode") == service.get("multinode")  # nodeCount -> nodes -> nodeCount
    assert all(f"#   {n}" in out.read_text() for n in imported.notes)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_flag_of_the_examples_comes_back(example: Path, tmp_path: Path) -> None:
    original = yaml.safe_load(example.read_text())
    out = tmp_path / "graph.yaml"
    import_dgd_file(example, out)
    back = _dgd(out)
    for name, service in original["spec"]["services"].items():
        theirs, ours = service["extraPodSpec"]["mainContainer"], back["spec"]["services"][name]
        # Ours may add the served model name Dynamo defaults to, and the defaults made explicit.
        their_flags = set(parse_flags(theirs.get("args", [])))
        assert their_flags <= set(parse_flags(ours["extraPodSpec"]["mainContainer"]["args"]))


def test_import_makes_dynamos_kv_transfer_defaults_explicit(tmp_path: Path) -> None:
    vllm = import_dgd_file(UPSTREAM / "examples/backends/vllm/deploy/disagg_router.yaml", tmp_path / "v.yaml")
    for key in ("VllmPrefillWorker", "VllmDecodeWorker"):
        args = vllm.graph["components"][key]["engine_args"]
        assert args["kv_transfer_config"] == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert sum("made explicit: engine_args.kv_transfer_config" in n for n in vllm.notes) == 2
    given = import_dgd_file(
        UPSTREAM / "examples/backends/vllm/deploy/disagg-multinode.yaml", tmp_path / "m.yaml"
    )
    decode = given.graph["components"]["decode"]["engine_args"]["kv_transfer_config"]
    assert decode["kv_connector"] == "NixlConnector" and decode["engine_id"].startswith("vllm-disagg-decode")
    assert sum("--connector none not imported" in n for n in given.notes) == 2
    trt = import_dgd_file(UPSTREAM / "examples/backends/trtllm/deploy/disagg.yaml", tmp_path / "t.yaml")
    prefill = trt.graph["components"]["TRTLLMPrefillWorker"]["engine_args"]
    decode = trt.graph["components"]["TRTLLMDecodeWorker"]["engine_args"]
    assert prefill["cache_transceiver_config"] == {"backend": "DEFAULT"}
    assert decode["cache_transceiver_config"] == {"backend": "UCX", "max_tokens_in_buffer": 16384}
    assert "extra_engine_args" not in prefill
    # Rendered back, the engine config's settings ride in Dynamo's --override-engine-args.
    args = _dgd(tmp_path / "t.yaml")["spec"]["services"]["TRTLLMPrefillWorker"]["extraPodSpec"][
        "mainContainer"
    ]["args"]
    override = json.loads(args[args.index("--override-engine-args") + 1])
    assert (
        override["cache_transceiver_config"] == {"backend": "DEFAULT"} and override["max_num_tokens"] == 8192
    )
    # A config file that is not next to the DGD: said in the notes, the path kept.
    doc = yaml.safe_load((UPSTREAM / "examples/backends/trtllm/deploy/disagg.yaml").read_text())
    alone = import_dgd(doc)
    assert alone.graph["components"]["TRTLLMPrefillWorker"]["engine_args"] == {
        "extra_engine_args": "./examples/backends/trtllm/engine_configs/qwen3/prefill.yaml"
    }
    assert any("cache_transceiver_config) unknown here" in n for n in alone.notes)
    (tmp_path / "alone.yaml").write_text(yaml.safe_dump(doc))
    unreadable = import_dgd_file(tmp_path / "alone.yaml", tmp_path / "a.yaml")
    assert any(
        n.startswith("not runnable with our engines") and "cache_transceiver_config" in n
        for n in unreadable.notes
    )


def test_multinode_becomes_nodes_with_the_gpus_of_every_node(tmp_path: Path) -> None:
    # nodeCount 2, 4 GPUs per node, --tp-size 8: one replica of TP 8 over 2 nodes of 4 GPUs.
    dgd = UPSTREAM / "examples/backends/sglang/deploy/disagg-multinode.yaml"
    imported = import_dgd_file(dgd, tmp_path / "g.yaml")
    built = build(tmp_path / "g.yaml")
    for key in ("prefill", "decode"):
        comp = imported.graph["components"][key]
        assert comp["nodes"] == 2
        assert comp["gpus"] == {"per_replica": 8, "tensor_parallel_size": 8}
        assert comp["engine_args"]["disaggregation_transfer_backend"] == "nixl"
        assert built.graph.workers()[key].gpus_per_node == 4
        ranks = [p for p in built.plan.processes if p.component == key]
        assert [(p.group, p.rank, p.env["CUDA_VISIBLE_DEVICES"]) for p in ranks][:2] == [
            (f"{key}-0", 0, ranks[0].env["CUDA_VISIBLE_DEVICES"]),
            (f"{key}-0", 1, ranks[1].env["CUDA_VISIBLE_DEVICES"]),
        ]
        assert all(len(p.env["CUDA_VISIBLE_DEVICES"].split(",")) == 4 for p in ranks)
    assert not [n for n in imported.notes if "nodeCount" in n]


@pytest.mark.parametrize("dgd", DGD_FILES, ids=[dgd_id(p) for p in DGD_FILES])
def test_imported_deployments_compile_on_the_mocker_with_the_tiny_model(
    dgd: Path, tmp_path: Path, tiny_model: Path
) -> None:
    out = tmp_path / "graph.yaml"
    imported = import_dgd_file(dgd, out)
    graph = yaml.safe_load(out.read_text())
    built = build(out, mocker_overrides(graph, str(tiny_model)))  # our engines: the mocker hands KV over
    workers = [p for p in built.plan.processes if p.argv[3] == "out=mocker"]
    assert len(workers) == sum(c.get("replicas", 1) for c in graph["components"].values() if "engine" in c)
    assert all(str(tiny_model) in p.argv for p in workers)
    assert imported.name == graph["name"]


def test_import_keeps_what_has_no_equivalent_and_reports_it(tmp_path: Path) -> None:
    doc = yaml.safe_load((FIXTURES / "dynamo" / "examples" / "trtllm-agg.yaml").read_text())
    worker = doc["spec"]["services"]["TRTLLMWorker"]
    worker["resources"]["requests"] = {"cpu": "8"}
    worker["envs"] = [
        {"name": "DYN_LOG", "value": "debug"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ]
    doc["spec"]["services"]["Frontend"]["extraPodSpec"]["mainContainer"]["args"] = [
        "--router-mode", "kv", "--router-replica-sync", "--http-port", "8001",
    ]  # fmt: skip
    imported = import_dgd(doc)
    comps = imported.graph["components"]
    assert comps["TRTLLMWorker"]["engine_args"] == {"extra_engine_args": "engine_configs/agg.yaml"}
    assert comps["TRTLLMWorker"]["env"] == {"DYN_LOG": "debug"}
    assert comps["Frontend"]["router"] == {"mode": "kv"} and comps["Frontend"]["http"] == {"port": 8001}
    notes = "\n".join(imported.notes)
    for expected in ("resources.requests.cpu: 8", "HF_TOKEN", "--router-replica-sync", "extra_engine_args"):
        assert expected in notes
    assert all(f"#   {n}" in imported.text("x.yaml") for n in imported.notes)


def test_import_reads_roles_from_flags_and_router_mode_from_the_env() -> None:
    doc = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "d"},
        "spec": {
            "envs": [{"name": "DYN_ROUTER_MODE", "value": "kv"}],
            "services": {
                "Frontend": {"componentType": "frontend", "extraPodSpec": {"mainContainer": {
                    "args": ["python3 -m dynamo.frontend --http-port 8000"]}}},
                "P": {"componentType": "worker", "extraPodSpec": {"mainContainer": {
                    "command": ["/bin/sh", "-c"],
                    "args": ["python3 -m dynamo.trtllm --model-path m --disaggregation-mode prefill"]}}},
                "D": {"componentType": "worker", "replicas": 3, "extraPodSpec": {"mainContainer": {
                    "command": ["python3", "-m", "dynamo.vllm"],
                    "args": ["--model", "m", "--is-decode-worker"]}}},
            },
        },
    }  # fmt: skip
    comps = import_dgd(doc).graph["components"]
    assert comps["Frontend"]["router"] == {"mode": "kv"}
    assert (comps["P"]["engine"], comps["P"]["role"]) == ("trtllm", "prefill")
    assert (comps["D"]["engine"], comps["D"]["role"], comps["D"]["replicas"]) == ("vllm", "decode", 3)


def test_import_refuses_what_is_not_a_dgd() -> None:
    with pytest.raises(DgdError, match="kind"):
        import_dgd({"kind": "Deployment"})
    bad_worker = {"componentType": "worker", "extraPodSpec": {"mainContainer": {"args": ["./serve.sh"]}}}
    with pytest.raises(DgdError, match=r"python3 -m dynamo\.vllm"):
        import_dgd(
            {
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "DynamoGraphDeployment",
                "spec": {"services": {"w": bad_worker}},
            }
        )


def test_command_line_forms() -> None:
    assert command_line({"command": ["python3", "-m", "dynamo.vllm"], "args": ["--model", "x"]}) == (
        "dynamo.vllm",
        ["--model", "x"],
    )
    assert command_line({"args": ["python3 -m dynamo.frontend --http-port 8000"]}) == (
        "dynamo.frontend",
        ["--http-port", "8000"],
    )
    assert parse_flags(["--a", "1", "--b", "--c=2", "-tp", "-1"]) == [
        ("--a", "1"), ("--b", None), ("--c", "2"), ("-tp", "-1"),
    ]  # fmt: skip


def test_cli_import_and_render_report_problems_with_exit_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dynamo_graph.cli import main as cli_main

    runner = CliRunner()
    not_dgd = tmp_path / "deployment.yaml"
    not_dgd.write_text("kind: Deployment\n")
    result = runner.invoke(cli_main.app, ["import", str(not_dgd), "-o", str(tmp_path / "g.yaml")])
    assert result.exit_code == 2 and "expected kind: DynamoGraphDeployment" in result.output
    result = runner.invoke(cli_main.app, ["render", str(ROOT / "graphs" / "hello.yaml"), "-f", "dynamo-k8s"])
    assert result.exit_code == 2 and "Dynamo has no backend for engine 'echo_core'" in result.output
    out = tmp_path / "vllm-agg.yaml"
    result = runner.invoke(
        cli_main.app, ["import", str(FIXTURES / "dynamo" / "examples" / out.name), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("# Imported from vllm-agg.yaml by `dyngraph import`.")


def _router_graph(tmp_path: Path, router: dict) -> Path:
    graph = tmp_path / "router.yaml"
    graph.write_text(
        yaml.safe_dump(
            {
                "name": "routed",
                "models": {"m": {"path": "org/m"}},
                "components": {
                    "front": {"kind": "frontend", "router": router},
                    "back": {"kind": "worker", "model": "m", "engine": "mocker", "replicas": 2},
                },
            }
        )
    )
    return graph


ROUTERS = [
    {
        "mode": "kv",
        "kv_overlap_score_weight": 2.5,
        "temperature": 0.3,
        "use_kv_events": False,
        "session_affinity_ttl_secs": 45.0,
        "session_affinity_mode": "hard",
        "queue_threshold": 0.75,
        "queue_policy": "wspt",
    },
    {"mode": "kv", "queue_threshold": 0.0, "queue_policy": "priority", "session_affinity_ttl_secs": 5.0},
    {"mode": "kv"},
    {"mode": "round-robin"},
]


@pytest.mark.parametrize("router", ROUTERS, ids=["everything", "priority-queue", "kv", "round-robin"])
def test_router_keys_survive_render_and_import(tmp_path: Path, router: dict) -> None:
    """render -f dynamo-k8s, then import: the same router settings (defaults go unwritten)."""
    built = build(_router_graph(tmp_path, router), engines="dynamo")
    dgd = build_dgd(built.graph, built.plan)
    assert dgd_errors(dgd) == []
    args = dgd["spec"]["services"]["front"]["extraPodSpec"]["mainContainer"]["args"]
    if router.get("queue_threshold") is not None:
        assert "--router-queue-threshold" in args and "--router-max-queue-size" not in args
    imported = import_dgd(dgd).graph["components"]["front"].get("router", {})
    defaults = type(built.graph.components["front"].router)().model_dump()
    assert {**defaults, **imported} == {**defaults, **router}


def test_frontend_replicas_survive_render_and_import(tmp_path: Path) -> None:
    """A frontend's replicas are Dynamo's frontend pods, and come back as replicas."""
    built = build(_router_graph(tmp_path, {"mode": "kv"}), ["components.front.replicas=3"], engines="dynamo")
    dgd = build_dgd(built.graph, built.plan)
    assert dgd["spec"]["services"]["front"]["replicas"] == 3
    assert import_dgd(dgd).graph["components"]["front"]["replicas"] == 3


def test_router_keys_without_a_dynamo_flag_are_listed_in_the_header(tmp_path: Path) -> None:
    router = {"mode": "kv", "queue_threshold": 0.5, "queue_policy": "fcfs", "max_queue_size": 16}
    built = build(_router_graph(tmp_path, router), engines="dynamo")
    header = render_dynamo_k8s(built.graph, built.plan).split("\n---")[0]
    assert "components.front.router.cost: predictive" in header
    assert "components.front.router.queue_policy: fcfs (rendered as Dynamo's fcfs" in header
    assert "components.front.router.max_queue_size: 16 (Dynamo's queue is unbounded)" in header
    reserve = {"mode": "kv", "queue_threshold": 0, "queue_reserve": 1}
    built = build(_router_graph(tmp_path, reserve), engines="dynamo")
    header = render_dynamo_k8s(built.graph, built.plan).split("\n---")[0]
    assert "components.front.router.queue_reserve: 1 (Dynamo keeps no worker free)" in header
    dynamo_cost = {"mode": "kv", "cost": "dynamo"}
    built = build(_router_graph(tmp_path, dynamo_cost), engines="dynamo")
    assert "Not rendered" not in render_dynamo_k8s(built.graph, built.plan)


def test_import_reads_every_spelling_of_the_router_flags_and_reports_bad_values() -> None:
    doc = yaml.safe_load((FIXTURES / "dynamo" / "examples" / "vllm-agg.yaml").read_text())
    doc["spec"]["services"]["Frontend"]["extraPodSpec"]["mainContainer"]["args"] = [
        "--router-mode", "kv", "--kv-overlap-score-weight", "3", "--router-queue-policy", "lcfs",
        "--router-queue-threshold=0.2", "--router-temperature", "warm",
    ]  # fmt: skip
    imported = import_dgd(doc)
    router = imported.graph["components"]["Frontend"]["router"]
    assert router == {"mode": "kv", "kv_overlap_score_weight": 3.0, "queue_threshold": 0.2}
    notes = "\n".join(imported.notes)
    assert "--router-queue-policy lcfs: not one of fcfs, wspt" in notes
    assert "--router-temperature warm" in notes and "predictive cost" in notes


def _autoscaled_graph(tmp_path: Path, agg: bool = False) -> Path:
    def scale(target: dict) -> dict:
        return {
            "min_replicas": 1,
            "max_replicas": 3,
            "target": target,
            "interval_s": 10,
            "scale_down_delay_s": 60,
        }

    worker = {"kind": "worker", "model": "m", "engine": "mocker", "gpus": {"per_replica": 1}}
    components: dict = {"front": {"kind": "frontend"}}
    if agg:
        components["back"] = {**worker, "autoscale": scale({"ttft_p90_ms": 400})}
    else:
        prefill_target = {"ttft_p90_ms": 400, "waiting_requests": 4}
        components["prefill"] = {**worker, "role": "prefill", "autoscale": scale(prefill_target)}
        decode_target = {"itl_p90_ms": 40, "kv_usage": 0.7}
        components["decode"] = {**worker, "role": "decode", "autoscale": scale(decode_target)}
    graph = tmp_path / "scaled.yaml"
    doc = {
        "name": "scaled",
        "max_gpus": 5,
        "hosts": {"local": {"gpus": 8}},
        "models": {"m": {"path": "org/m"}},
    }
    graph.write_text(yaml.safe_dump({**doc, "components": components}))
    return graph


def test_autoscale_renders_as_dynamos_planner_and_imports_back(tmp_path: Path) -> None:
    """A P/D pair's autoscale is Dynamo's Planner (strictly valid DGD), what it cannot say is in the
    header, and import turns the Planner back into autoscale on both pools."""
    built = build(_autoscaled_graph(tmp_path), engines="dynamo")
    dgd = build_dgd(built.graph, built.plan)
    assert dgd_errors(dgd) == []
    planner = dgd["spec"]["services"]["Planner"]
    assert planner["componentType"] == "planner"
    args = planner["extraPodSpec"]["mainContainer"]["args"]
    for flag in (
        "--environment=kubernetes",
        "--backend=mocker",
        "--adjustment-interval=10",
        "--min-endpoint=1",
    ):
        assert flag in args
    assert {"--max-gpu-budget=5", "--ttft=400", "--itl=40", "--prefill-engine-num-gpu=1"} <= set(args)
    assert "--decode-kv-scale-up-threshold=0.7" in args  # load mode's KV threshold
    header = render_dynamo_k8s(built.graph, built.plan).split("\n---")[0]
    assert "components.prefill.autoscale.scale_down_delay_s: 60" in header
    assert "components.prefill.autoscale.target.waiting_requests: 4 (Dynamo's load mode" in header
    assert "max_replicas: 3/3 (Dynamo's Planner bounds both pools by one GPU budget" in header

    imported = import_dgd(dgd)
    comps = imported.graph["components"]
    assert imported.graph["max_gpus"] == 5
    assert comps["prefill"]["autoscale"]["target"] == {"ttft_p90_ms": 400.0}
    assert comps["decode"]["autoscale"]["target"] == {"itl_p90_ms": 40.0, "kv_usage": 0.7}
    assert comps["decode"]["autoscale"]["interval_s"] == 10.0
    assert comps["decode"]["autoscale"]["max_replicas"] == 4  # the budget less the other pool's floor
    assert any("one GPU budget for both pools" in n for n in imported.notes)
    assert not any("Planner" in n and "not imported" in n for n in imported.notes)
    rebuilt = tmp_path / "back.yaml"
    rebuilt.write_text(imported.text("dgd"))
    again = build(rebuilt, engines="dynamo")  # the imported graph validates
    assert again.graph.components["prefill"].autoscale is not None


def test_an_aggregated_autoscale_is_listed_not_rendered(tmp_path: Path) -> None:
    built = build(_autoscaled_graph(tmp_path, agg=True), engines="dynamo")
    assert "Planner" not in build_dgd(built.graph, built.plan)["spec"]["services"]
    text = render_dynamo_k8s(built.graph, built.plan)
    assert "components.back.autoscale: Dynamo's Planner sizes only disaggregated" in text
