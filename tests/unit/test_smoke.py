"""`dyngraph test`'s parts without processes: the `tests:` schema and its file:line errors, /metrics
expressions, expectations, the isolated plan, and the JUnit report."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from rich.console import Console

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.metric_expr import parse_metric_expr
from dynamo_graph.graph.schema import Expect, SmokeChat, SmokeCompletion, TokenCount
from dynamo_graph.smoke.client import Answer, request_body
from dynamo_graph.smoke.expect import unmet
from dynamo_graph.smoke.isolate import isolated
from dynamo_graph.smoke.report import write_junit
from dynamo_graph.smoke.results import CheckResult, GraphResult, exit_code
from dynamo_graph.smoke.run import check_graph

GRAPH = """\
name: g
models:
  m:
    path: /models/m
    name: served-m
infra:
  etcd:
    managed: true
    client_port: 2379
components:
  frontend:
    kind: frontend
    http:
      port: 8080
  backend:
    kind: worker
    model: m
    engine: mocker
    replicas: 2
    tcp_port: 9000
"""


def exposition() -> str:
    registry = CollectorRegistry()
    requests = Counter("dynamo_frontend_requests", "r", ["model", "status"], registry=registry)
    requests.labels("a", "success").inc(3)
    requests.labels("b", "success").inc(2)
    requests.labels("a", "error").inc()
    ttft = Histogram("dynamo_frontend_time_to_first_token_seconds", "t", ["model"], registry=registry)
    ttft.labels("a").observe(0.1)
    return generate_latest(registry).decode()


@pytest.mark.parametrize(
    ("expr", "value", "holds"),
    [
        ("dynamo_frontend_requests_total >= 6", 6.0, True),
        ('dynamo_frontend_requests_total{model="a"} == 4', 4.0, True),
        ('dynamo_frontend_requests_total{model="a",status="success"} > 3', 3.0, False),
        ('dynamo_frontend_requests_total{status!="error"} == 5', 5.0, True),
        ('dynamo_frontend_requests_total{model=~"a|b", status!~"err.*"} < 5.5', 5.0, True),
        ("dynamo_frontend_time_to_first_token_seconds_count{} != 0", 1.0, True),
    ],
)
def test_metric_expressions_sum_matching_samples(expr: str, value: float, holds: bool) -> None:
    parsed = parse_metric_expr(expr)
    assert parsed.value(exposition()) == value
    assert parsed.holds(value) is holds


def test_a_metric_expression_without_matches_has_no_value() -> None:
    assert parse_metric_expr('dynamo_frontend_requests_total{model="zzz"} >= 0').value(exposition()) is None


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("requests >> 3", "is not `NAME"),
        ("requests{model=a} > 1", 'is not `label="value"`'),
        ('requests{model=~"("} > 1', "bad regex"),
        ("3 > requests", "is not `NAME"),
    ],
)
def test_bad_metric_expressions_say_why(expr: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        parse_metric_expr(expr)


def test_label_values_may_hold_commas_and_quotes() -> None:
    parsed = parse_metric_expr(r'x{a="1,2",b="say \"hi\""} == 1')
    assert [(m.label, m.value) for m in parsed.matchers] == [("a", "1,2"), ("b", 'say "hi"')]


def answer(**kw: object) -> Answer:
    base: dict[str, object] = {
        "status": 200,
        "text": "hello world",
        "finish_reason": "stop",
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "latency_s": 0.5,
        "ttft_s": 0.1,
    }
    return Answer(**{**base, **kw})  # type: ignore[arg-type]


def test_expectations_met_and_unmet() -> None:
    assert unmet(answer(), Expect(contains=["hello"], regex=r"w.rld", completion_tokens=2, ttft_s=1)) == []
    failures = unmet(
        answer(tool_calls=["f"]),
        Expect(
            contains=["bye"],
            regex="^world",
            finish_reason="length",
            prompt_tokens=TokenCount(max=4),
            completion_tokens=TokenCount(min=3),
            tool_calls=["g"],
            ttft_s=0.05,
            latency_s=0.25,
        ),
    )
    assert failures == [
        "text does not contain 'bye': 'hello world'",
        "text does not match /^world/: 'hello world'",
        "finish_reason 'stop', expected 'length'",
        "prompt_tokens 5, expected at most 4",
        "completion_tokens 2, expected at least 3",
        "tool calls ['f'], expected ['g']",
        "time to first token 0.100 s, budget 0.05 s",
        "latency 0.500 s, budget 0.25 s",
    ]


def test_a_wrong_status_is_reported_alone_and_protocol_problems_always() -> None:
    got = answer(status=503, text="no instances", problems=["the stream ended without `data: [DONE]`"])
    assert unmet(got, Expect(contains=["x"])) == [
        "the stream ended without `data: [DONE]`",
        "status 503, expected 200: no instances",
    ]
    assert (
        unmet(answer(status=400, text="temperature must be >= 0"), Expect(status=400, contains="temperature"))
        == []
    )


def test_request_bodies() -> None:
    chat = SmokeChat(prompt="hi", max_tokens=3, stream=True, seed=1, extra={"top_k": 2})
    assert request_body(chat, "m") == {
        "model": "m",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_k": 2,
    }
    completion = SmokeCompletion(model="other", prompt="p", stop="\n")
    assert request_body(completion, "m") == {
        "model": "other",
        "max_tokens": 16,
        "prompt": "p",
        "stop": ["\n"],
    }


def write(tmp_path: Path, tests: str) -> Path:
    path = tmp_path / "g.yaml"
    path.write_text(GRAPH + tests)
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(GraphError) as e:
        build(path)
    return [str(p) for p in e.value.problems]


def test_cross_key_problems_name_file_line_and_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
tests:
  - chat: {prompt: hi, model: m}
  - models: [served-m]
    frontend: front
  - fault: {kill: backend, replica: 2}
  - fault: {kill: nobody}
  - completion: {prompt: hi, model: served-m}
""",
    )
    assert problems(path) == [
        f"{path}:22: tests.0.chat.model: no model served named 'm'; allowed: served-m",
        f"{path}:24: tests.1.frontend: no frontend named 'front'; did you mean 'frontend'?",
        f"{path}:26: tests.3.fault.kill: no component named 'nobody'; allowed: backend, frontend",
    ]


def test_a_fault_on_a_replica_that_does_not_run_stops_only_dyngraph_test(tmp_path: Path) -> None:
    """`up` and `bench --sweep` may run fewer replicas than the checks were written for."""
    path = write(
        tmp_path, "tests:\n  - fault: {kill: backend, replica: 2}\n  - fault: {kill: frontend, replica: 1}\n"
    )
    build(path)  # valid for up, render and bench
    out = io.StringIO()
    result = check_graph(path, [], Console(file=out, width=200))
    assert result.problems == [
        f"{path}:22: tests.0.fault.replica: backend runs 2 replica(s), counted from 0",
        f"{path}:23: tests.1.fault.replica: frontend runs 1 replica(s), counted from 0",
    ]
    assert check_graph(path, ["+components.frontend.replicas=2"], Console(file=out, width=200)).problems == [
        f"{path}:22: tests.0.fault.replica: backend runs 2 replica(s), counted from 0"
    ]
    assert exit_code([result]) == 2


def test_schema_problems_of_checks(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
tests:
  - name: nothing to do
  - completion: {prompt: hi}
    expect: {tool_calls: [f], regex: "("}
  - metrics: x > 1
    repeat: 2
  - chat: {prompt: hi, messages: []}
  - chat: {prompt: hi}
    expect: {completion_tokens: {min: 3, max: 2}, finish_reason: done}
""",
    )
    found = "\n".join(problems(path))
    assert f"{path}:22: tests.0.chat: give exactly one of chat, completion, models, metrics, fault" in found
    assert f"{path}:24: tests.1.expect.regex: not a regular expression" in found
    assert f"{path}:26: tests.2.repeat: only a `chat` or `completion` check repeats" in found
    assert f"{path}:27: tests.3.chat.prompt: give either `messages` or `prompt`" in found
    assert f"{path}:29: tests.4.expect.completion_tokens.max: must be at least `min`" in found
    assert (
        "tests.4.expect.finish_reason: 'done' is not one of stop, length, tool_calls, content_filter" in found
    )


def test_the_isolated_plan_moves_every_movable_port_and_state(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    built = build(path)
    graph, plan = isolated(built.graph, built.loaded.file, parent=tmp_path)
    assert built.graph.components["frontend"].http.port == 8080, "the built graph is left as it was"
    assert graph.components["frontend"].http.port == "auto"
    assert graph.infra.etcd is not None and graph.infra.etcd.client_port == "auto"
    assert Path(plan.state_dir).parent == tmp_path and Path(plan.state_dir).name.startswith(
        "dyngraph-test-g-"
    )
    pinned = {p for spec in plan.processes for p in spec.ports.values() if isinstance(p, int)}
    assert pinned == set(), f"ports still pinned: {pinned}"
    assert all("8080" not in arg and "9000" not in arg for spec in plan.processes for arg in spec.argv)


def test_junit_names_the_failed_check_and_exit_codes(tmp_path: Path) -> None:
    results = [
        GraphResult("a.yaml", "a", [CheckResult("chat", "passed", 0.1, detail="200")]),
        GraphResult("b.yaml", "b", [CheckResult("says hi", "failed", 0.2, ["text does not contain 'hi'"])]),
        GraphResult(
            "c.yaml", "c", [CheckResult("up", "error", 1.0, ["backend-0: exited with 1"], output="boom")]
        ),
        GraphResult("d.yaml", problems=["d.yaml:3: name: required key is missing"]),
    ]
    results[2].up_failure = "backend-0: exited with 1"
    assert [r.status for r in results] == [0, 1, 2, 2]
    assert exit_code(results) == 2 and exit_code(results[:2]) == 1 and exit_code([]) == 0
    path = tmp_path / "out" / "junit.xml"
    write_junit(path, results, 3.0)
    root = ET.parse(path).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("4", "1", "2")
    failure = root.find("testsuite[@name='b.yaml']/testcase[@name='says hi']/failure")
    assert failure is not None and failure.get("message") == "says hi: text does not contain 'hi'"
    error = root.find("testsuite[@name='c.yaml']/testcase[@name='up']/error")
    assert error is not None and "boom" in (error.text or "")
    invalid = root.find("testsuite[@name='d.yaml']/testcase[@name='validate']/error")
    assert invalid is not None and "required key is missing" in (invalid.text or "")


def test_the_example_ci_workflow_runs_dyngraph_test_with_junit() -> None:
    import yaml

    workflow = Path(__file__).resolve().parents[2] / "examples" / "ci" / "github-actions-dyngraph-test.yml"
    steps = yaml.safe_load(workflow.read_text())["jobs"]["smoke"]["steps"]
    runs = [s.get("run", "") for s in steps]
    assert any(r.startswith("pip install dyngraph") for r in runs)
    (test_step,) = [s for s in steps if s.get("run", "").startswith("dyngraph test ")]
    junit = test_step["run"].split("--junit ")[1]
    assert any(s.get("with", {}).get("report_paths") == junit for s in steps)
