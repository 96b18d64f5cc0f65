"""The kv router's cost, session affinity and queue options: graph keys -> flags -> config."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_graph.backend.command_line import parse_fast
from dynamo_graph.backend.run_config import RunConfigError, run_config_from_args, validate
from dynamo_graph.graph.build import build
from dynamo_graph.inputs.launch import kv_router_config
from tests.support.graph_problems import MINIMAL, problems

GRAPH = """
name: demo
models:
  tiny: {path: ./model}
components:
  frontend:
    kind: frontend
    router:
      mode: kv
      cost: dynamo
      session_affinity_ttl_secs: 30
      session_affinity_mode: hard
      queue_threshold: 0.5
      queue_policy: priority
      max_queue_size: 16
      queue_reserve: 1
  backend: {kind: worker, model: tiny, engine: mocker}
"""


def test_graph_router_keys_become_flags_and_the_flags_a_config(tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH)
    frontend = next(p for p in build(path).plan.processes if p.name.startswith("frontend"))
    argv = frontend.argv
    run_args = argv[argv.index("run") + 1 :]
    parsed = parse_fast(run_args)
    assert parsed is not None
    cfg, _ = run_config_from_args(*parsed)
    validate(cfg)
    config = kv_router_config(cfg)
    assert (config.cost, config.session_affinity_ttl_s, config.session_affinity_mode) == (
        "dynamo",
        30,
        "hard",
    )
    assert (config.queue_threshold, config.queue_policy, config.max_queue_size) == (0.5, "priority", 16)
    assert config.queue_reserve == 1


def test_default_graphs_compile_to_the_same_command_line_as_before(tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    plain = "\n".join(line for line in GRAPH.splitlines() if not line.startswith("      "))
    path.write_text(plain.replace("router:", "router: {mode: kv}"))
    frontend = next(p for p in build(path).plan.processes if p.name.startswith("frontend"))
    assert not [
        a for a in frontend.argv if a.startswith(("--router-cost", "--router-queue", "--router-session"))
    ]


@pytest.mark.parametrize(
    "setting",
    [
        "queue_threshold: 0.5",
        "queue_policy: fcfs",
        "max_queue_size: 8",
        "session_affinity_ttl_secs: 30",
        "session_affinity_mode: hard",
    ],
)
def test_affinity_or_queue_keys_without_kv_routing_are_refused_with_the_key_and_line(setting: str) -> None:
    text = MINIMAL.replace("kind: frontend", f"kind: frontend\n    router: {{mode: round-robin, {setting}}}")
    [problem] = problems(text)
    assert problem.path == "components.frontend.router"
    assert setting.split(":")[0] in problem.message and "mode: kv" in problem.message
    assert problem.location is not None and problem.location.line > 0


def test_a_queue_reserve_without_a_priority_queue_is_refused_with_its_line() -> None:
    text = MINIMAL.replace("kind: frontend", "kind: frontend\n    router: {mode: kv, queue_reserve: 1}")
    [problem] = problems(text)
    assert problem.path == "components.frontend.router" and "queue_threshold" in problem.message
    assert problem.location is not None and problem.location.line > 0


def test_the_queue_threshold_is_a_fraction_and_refused_negative_with_its_line() -> None:
    text = MINIMAL.replace("kind: frontend", "kind: frontend\n    router: {mode: kv, queue_threshold: -0.5}")
    [problem] = problems(text)
    assert problem.path == "components.frontend.router.queue_threshold"
    assert problem.location is not None and problem.location.line > 0


FCFS_QUEUE = ["--router-mode", "kv", "--router-queue-threshold", "0", "--router-queue-policy", "fcfs"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--router-cost", "cheapest"], "--router-cost must be one of predictive, dynamo"),
        (["--router-session-affinity-mode", "sticky"], "--router-session-affinity-mode"),
        (["--router-queue-policy", "lifo"], "--router-queue-policy"),
        (["--router-mode", "kv", "--router-queue-threshold", "-1"], "--router-queue-threshold is a fraction"),
        (["--router-queue-threshold", "0.5"], "--router-queue-threshold: .* add --router-mode kv"),
        (["--router-queue-policy", "fcfs"], "--router-queue-policy: .*not --router-mode round-robin"),
        (["--router-max-queue-size", "8"], "--router-max-queue-size: .* add --router-mode kv"),
        (["--router-mode", "kv", "--router-queue-reserve", "1"], "--router-queue-reserve .* needs the queue"),
        ([*FCFS_QUEUE, "--router-queue-reserve", "1"], "--router-queue-reserve .* priority order"),
        (["--router-mode", "kv", "--router-queue-reserve", "-1"], "--router-queue-reserve must be >= 0"),
        (["--router-mode", "random", "--router-session-affinity-mode", "hard"], "not --router-mode random"),
    ],
)
def test_bad_router_flags_are_named(flags: list[str], message: str) -> None:
    parsed = parse_fast(["in=http", "out=auto", *flags])
    assert parsed is not None
    cfg, _ = run_config_from_args(*parsed)
    with pytest.raises(RunConfigError, match=message):
        validate(cfg)
