"""Settings declared once (dynamo_graph/options.py): a graph's sections compile to flags that
parse back to the same settings; the fast parser and typer agree; every rule has one wording,
spelled as flags on the command line and as keys in a graph."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dynamo_graph.backend.settings import EngineSettings, RunConfigError, WorkerSettings
from dynamo_graph.cli import main as cli_main
from dynamo_graph.cli import run as cli_run
from dynamo_graph.frontend.settings import LimitSettings
from dynamo_graph.graph.build import build
from dynamo_graph.graph.compile import compile_graph
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.targets.local.ports import fill_plan
from dynamo_graph.graph.validate import validate_graph
from dynamo_graph.options import options
from dynamo_graph.process.run_config import RUN_OPTIONS, parse_run_args, parse_run_config
from dynamo_graph.router.config import DisaggConfig, RouterConfig

# ---- graph -> argv -> parse -> settings ----------------------------------------------------------

_fraction = st.floats(min_value=0, max_value=4, allow_nan=False).map(lambda x: round(x, 3))
ROUTERS = st.one_of(
    st.fixed_dictionaries(
        {"mode": st.sampled_from(["random", "round-robin"])},
        optional={
            "kv_overlap_score_weight": _fraction,
            "temperature": _fraction,
            "use_kv_events": st.booleans(),
        },
    ),
    st.fixed_dictionaries(
        {"mode": st.just("kv")},
        optional={
            "kv_overlap_score_weight": _fraction,
            "temperature": _fraction,
            "use_kv_events": st.booleans(),
            "cost": st.sampled_from(["predictive", "dynamo"]),
            "session_affinity_ttl_secs": _fraction,
            "session_affinity_mode": st.sampled_from(["hard", "soft"]),
            "queue_threshold": _fraction,
            "queue_policy": st.sampled_from(["fcfs", "wspt"]),
            "max_queue_size": st.integers(0, 5000),
        },
    ),
    st.fixed_dictionaries(  # the reserve needs the queue in priority order
        {"mode": st.just("kv"), "queue_threshold": _fraction, "queue_reserve": st.integers(0, 4)}
    ),
)
LIMITS = st.fixed_dictionaries(
    {},
    optional={
        "max_concurrent_requests": st.integers(0, 10_000),
        "request_timeout_s": st.floats(0.5, 600).map(lambda x: round(x, 2)),
        "body_limit_mb": st.floats(0.5, 512).map(lambda x: round(x, 2)),
        "health_check_interval_s": _fraction,
        "health_check_timeout_s": st.floats(0.5, 30).map(lambda x: round(x, 2)),
    },
)
DISAGG = st.fixed_dictionaries(
    {},
    optional={
        "conditional": st.booleans(),
        "max_local_prefill_length": st.integers(0, 8192),
        "enforce": st.booleans(),
    },
)
WORKERS = st.fixed_dictionaries(
    {},
    optional={
        "migration_limit": st.integers(0, 5),
        "max_inflight": st.integers(0, 4096),
        "role": st.sampled_from(["agg", "decode"]),
        "metrics_port": st.sampled_from(["auto", None, 9400]),
    },
)


def _graph(router: dict, limits: dict, disagg: dict, worker: dict) -> dict[str, Any]:
    return {
        "name": "demo",
        "models": {"tiny": {"path": "./model", "context_length": 2048, "kv_cache_block_size": 32}},
        "components": {
            "frontend": {"kind": "frontend", "router": router, "limits": limits, "disagg": disagg},
            "backend": {"kind": "worker", "model": "tiny", "engine": "mocker", **worker},
            **(
                {"prefill": {"kind": "worker", "model": "tiny", "engine": "mocker", "role": "prefill"}}
                if worker.get("role") == "decode"
                else {}
            ),
        },
    }


def _run_args(argv: list[str]) -> list[str]:
    return argv[argv.index("run") + 1 :]


@settings(
    max_examples=60,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),  # a failure prints its example; shrinking a build is slow
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(router=ROUTERS, limits=LIMITS, disagg=DISAGG, worker=WORKERS)
def test_graph_sections_compile_to_flags_that_parse_back_to_the_same_settings(
    tmp_path: Path, router: dict, limits: dict, disagg: dict, worker: dict
) -> None:
    # The graph layer's stages without Hydra's loading (0.5 s a graph): validate, then compile.
    graph = validate_graph(_graph(router, limits, disagg, worker), None, file="graph.yaml")
    plan = compile_graph(graph, graph_file=tmp_path / "graph.yaml", state_dir=tmp_path / "state")
    ports: dict[str, int] = {}
    processes = {p.component: p for p in fill_plan(plan, ports).processes}  # `auto` ports, as `up` does

    front = parse_run_config(_run_args(processes["frontend"].argv))
    section = graph.components["frontend"]
    assert front.router == RouterConfig(**section.router.model_dump())
    assert front.limits == LimitSettings(**section.limits.model_dump())
    assert front.disagg == DisaggConfig(**section.disagg.model_dump())

    back = parse_run_config(_run_args(processes["backend"].argv))
    spec = graph.components["backend"]
    assert back.engine.disaggregation_mode == spec.role
    assert (back.engine.context_length, back.engine.kv_cache_block_size) == (2048, 32)
    assert back.worker.migration_limit == (spec.migration_limit or 0)
    assert back.worker.max_inflight == (1024 if spec.max_inflight is None else spec.max_inflight)
    auto_port = ports.get("backend-0.metrics")
    assert back.worker.metrics_port == (auto_port if spec.metrics_port == "auto" else spec.metrics_port)


def test_defaults_compile_to_no_flags(tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(_graph({"mode": "round-robin"}, {}, {}, {})))
    frontend = next(p for p in build(path).plan.processes if p.component == "frontend")
    assert [a for a in _run_args(frontend.argv) if a.startswith("--")] == ["--http-host", "--http-port"]


def test_every_graph_key_of_a_section_is_a_setting_with_a_doc() -> None:
    from dynamo_graph.graph.schema import Disagg, Limits, Router

    for model, cls in ((Router, RouterConfig), (Limits, LimitSettings), (Disagg, DisaggConfig)):
        graph_keys = {o.name for o in options(cls) if o.spec.in_graph}
        assert set(model.model_fields) == graph_keys
        for name, info in model.model_fields.items():
            flag = next(o.flag for o in options(cls) if o.name == name)
            assert info.description and info.description.endswith(f"Flag: `{flag}`."), name


# ---- the command line: fast parser and typer -------------------------------------------------------


def _via_typer(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict, set[str]]:
    seen: list[tuple[list[str], dict, set[str]]] = []

    def fake_execute(words: list[str] | None, params: dict, explicit: set[str]) -> int:
        seen.append((list(words or []), params, explicit))
        return 0

    monkeypatch.setattr(cli_run, "execute", fake_execute)
    result = CliRunner().invoke(cli_main.app, ["run", *args])
    assert result.exit_code == 0, result.output
    return seen[0]


def _every_flag_once() -> list[str]:
    """One command line giving every flag a valid non-default value."""
    args = []
    for opt in RUN_OPTIONS:
        assert opt.flag is not None
        if opt.kind is bool and not opt.spec.bool_word:
            args.append(opt.flag)
        elif opt.choices:
            args += [opt.flag, next(c for c in opt.choices if c != opt.default)]
        elif opt.spec.bool_word:
            args += [opt.flag, "false"]
        elif opt.kind is int:
            args += [opt.flag, "3"]
        elif opt.kind is float:
            args += [opt.flag, "2.5"]
        else:
            args += [opt.flag, f"value-of-{opt.param}"]
    return args


@pytest.mark.parametrize(
    "args",
    [
        [
            "in=dyn://hello.backend.generate",
            "out=echo_core",
            "--model-path",
            "/m/tiny",
            "--model-name",
            "tiny",
        ],
        ["in=http", "out=auto", "--http-port", "8080", "--router-mode", "kv", "--use-kv-events", "true"],
        ["out=echo_core", "/m/tiny", "--static-worker", "-vv", "--extra-engine-args", "e.json"],
        ["--node-rank=-1", "--context-length=64", "--verbose", "in=none", "out=echo"],
        [],
        _every_flag_once(),
    ],
)
def test_fast_parse_agrees_with_typer(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_run_args(args) == _via_typer(args, monkeypatch)


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--http-port", "80x"],
        ["--http-port"],
        ["--bogus", "1"],
        ["--model-name", "-x"],
        ["--router-temperature", "1e-3"],
        ["--static-worker=yes"],
    ],
)
def test_unusual_command_lines_go_to_typer(args: list[str]) -> None:
    assert parse_run_args(args) is None


def test_typed_values_and_the_engines_arguments() -> None:
    parsed = parse_run_args(
        ["in=dyn://a.b.c", "--http-port", "9000", "--extra-engine-args", "a.json", "--", "-x"]
    )
    assert parsed is not None
    words, params, explicit = parsed
    assert words == ["in=dyn://a.b.c"]
    assert (params["http_port"], params["extra_engine_args"]) == (9000, Path("a.json"))
    assert explicit == {"words", "http_port", "extra_engine_args"}
    assert params["engine_argv"] == ["-x"]


def test_help_shows_every_flag_with_its_fields_doc() -> None:
    result = CliRunner().invoke(cli_main.app, ["run", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    for opt in RUN_OPTIONS:
        assert opt.flag in result.output
    assert "workers kept free of ordinary prefill work" in result.output


def test_engine_settings_are_the_engines_part_of_the_command_line() -> None:
    cfg = parse_run_config(["out=mocker", "/m", "--tensor-parallel-size", "2", "--http-port", "9001"])
    assert cfg.engine == EngineSettings(
        engine="mocker", model_path="/m", tensor_parallel_size=2, http_port=9001, explicit=cfg.engine.explicit
    )
    assert dataclasses.asdict(cfg.worker) == dataclasses.asdict(WorkerSettings())


# ---- one rule, one wording: flags on the command line, keys in a graph ---------------------------

FCFS_QUEUE = ["--router-mode", "kv", "--router-queue-threshold", "0", "--router-queue-policy", "fcfs"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--router-cost", "cheapest"], "--router-cost must be one of predictive, dynamo"),
        (["--router-session-affinity-mode", "sticky"], "--router-session-affinity-mode must be one of"),
        (
            ["--router-mode", "kv", "--router-queue-threshold", "-1"],
            "--router-queue-threshold must be at least 0",
        ),
        (["--router-queue-threshold", "0.5"], "--router-queue-threshold: .* use --router-mode kv"),
        (["--router-queue-policy", "fcfs"], "--router-queue-policy: .*not --router-mode round-robin"),
        (["--router-mode", "kv", "--router-queue-reserve", "1"], "--router-queue-reserve .* needs the queue"),
        ([*FCFS_QUEUE, "--router-queue-reserve", "1"], "--router-queue-reserve .* priority order"),
        (
            ["--router-mode", "kv", "--router-queue-reserve", "-1"],
            "--router-queue-reserve must be at least 0",
        ),
        (["--router-mode", "random", "--router-session-affinity-mode", "hard"], "not --router-mode random"),
        (["--use-kv-events", "maybe"], "--use-kv-events takes true or false"),
        (["--http-port", "70000"], "--http-port must be at most 65535"),
        (["--http-port", "0", "--http-processes", "2"], "--http-processes needs a fixed --http-port"),
        (["--http-processes", "0"], "--http-processes must be at least 1"),
        (["--max-concurrent-requests", "-1"], "--max-concurrent-requests must be at least 0"),
        (["--request-timeout-s", "0"], "--request-timeout-s must be above 0"),
        (["--num-nodes", "2"], "--num-nodes > 1 needs --leader-addr"),
        (["--node-rank", "1"], "--node-rank 1 must be below --num-nodes 1"),
        (["--disaggregation-mode", "both"], "--disaggregation-mode must be one of agg, prefill, decode"),
        (["--is-prefill-worker", "--is-decode-worker"], "a worker is one or the other"),
        (["--dyn-reasoning-parser", "nope"], "--dyn-reasoning-parser: unknown parser"),
    ],
)
def test_bad_flags_are_named(flags: list[str], message: str) -> None:
    with pytest.raises(RunConfigError, match=message):
        parse_run_config(["in=http", "out=auto", *flags])


def test_frontend_processes_need_workers_to_share() -> None:
    """Processes of one port serve the same discovered workers; an in-process engine would be copied."""
    with pytest.raises(RunConfigError, match=r"--http-processes 2 runs that many frontends .* out=echo_core"):
        parse_run_config(["in=http", "out=echo_core", "/m", "--http-processes", "2"])
    assert parse_run_config(["in=http", "out=auto", "--http-processes", "2"]).http.processes == 2


def test_a_worker_ignores_router_rules_but_not_router_bounds() -> None:
    cfg = parse_run_config(["in=dyn://a.b.c", "out=mocker", "--router-queue-threshold", "0.5"])
    assert cfg.router.queue_threshold == 0.5  # reported unused at start, not refused
    with pytest.raises(RunConfigError, match="--router-temperature must be at least 0"):
        parse_run_config(["in=dyn://a.b.c", "out=mocker", "--router-temperature", "-1"])


def _graph_problem(tmp_path: Path, router: str) -> Any:
    path = tmp_path / "graph.yaml"
    path.write_text(
        "name: demo\nmodels:\n  tiny: {path: ./model}\ncomponents:\n  frontend:\n    kind: frontend\n"
        f"    router: {router}\n  backend: {{kind: worker, model: tiny, engine: echo_core}}\n"
    )
    with pytest.raises(GraphError) as info:
        build(path)
    [problem] = info.value.problems
    assert problem.location is not None and problem.location.line > 0
    return problem


@pytest.mark.parametrize(
    "key",
    ["queue_threshold: 0.5", "queue_policy: fcfs", "max_queue_size: 8", "session_affinity_ttl_secs: 30"],
)
def test_kv_only_keys_without_kv_routing_are_refused_with_the_key_and_line(tmp_path: Path, key: str) -> None:
    problem = _graph_problem(tmp_path, f"{{mode: round-robin, {key}}}")
    assert problem.path == "components.frontend.router"
    assert (
        f"{key.split(':')[0]}: session affinity and the router queue are the kv router's" in problem.message
    )
    assert "use mode kv" in problem.message


def test_a_queue_reserve_without_the_queue_is_refused_in_the_same_words_as_the_flag(tmp_path: Path) -> None:
    problem = _graph_problem(tmp_path, "{mode: kv, queue_reserve: 1}")
    assert "queue_reserve keeps workers free for urgent requests: it needs the queue (queue_threshold)" in (
        problem.message
    )
    with pytest.raises(RunConfigError) as err:
        parse_run_config(["in=http", "out=auto", "--router-mode", "kv", "--router-queue-reserve", "1"])
    assert str(err.value).replace("--router-", "").replace("-", "_") in problem.message.replace("-", "_")


def test_a_negative_queue_threshold_is_refused_at_its_key(tmp_path: Path) -> None:
    problem = _graph_problem(tmp_path, "{mode: kv, queue_threshold: -0.5}")
    assert problem.path == "components.frontend.router.queue_threshold"


def test_the_settings_reference_in_docs_is_current() -> None:
    from dynamo_graph.graph.reference import reference

    path = Path(__file__).resolve().parents[2] / "docs" / "reference" / "settings.md"
    regenerate = "python -m dynamo_graph.graph.reference > docs/reference/settings.md"
    assert path.read_text() == reference(), f"stale: run {regenerate}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["in=dyn://a.b.c", "out=auto"], "serves an engine: give out=ENGINE"),
        (["in=http", "out=auto", "--lora-modules", "a=/x"], "--lora-modules is a worker's flag"),
        (["in=none", "out=mocker", "/m", "--lora-modules", "a=/x"], "serves adapters as models over HTTP"),
    ],
)
def test_the_words_and_the_flags_must_fit_together(args: list[str], message: str) -> None:
    with pytest.raises(RunConfigError, match=message):
        parse_run_config(args)
