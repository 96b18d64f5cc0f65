"""`dyngraph top`'s table model, from two samples built by hand: rates and percentiles over the
interval, gauges as they are, sorting, filtering and the keys; and the rendering of a table."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rich.console import Console

from dynamo_graph.graph.plan import Plan, Probe, ProcessSpec, RestartPolicy
from dynamo_graph.graph.targets.local.answers import Answers
from dynamo_graph.graph.targets.local.state import ProcessRecord, StateDir
from dynamo_graph.graph.targets.local.top import Sample, arrange, parse_metrics, table
from dynamo_graph.graph.targets.local.top_view import View, render, top

RESTART = RestartPolicy("on-failure", 5, 1.0, 10.0)


def _spec(name: str, component: str, probe: Probe, shares_ports: bool = False) -> ProcessSpec:
    return ProcessSpec(
        name, component, 0, "local", [], {}, "/", {}, [], probe, RESTART, 10.0, shares_ports=shares_ports
    )


PLAN = Plan(
    "g",
    "ns",
    "g.yaml",
    "/state",
    {},
    [
        _spec("frontend-0", "frontend", Probe("http", "http://127.0.0.1:8000/health", 30), shares_ports=True),
        _spec("backend-0", "backend", Probe("log", "serving model", 30)),
        _spec("backend-1", "backend", Probe("log", "serving model", 30)),
        _spec("etcd", "etcd", Probe("tcp", "127.0.0.1:2379", 30)),
    ],
)


def _metrics(requests: int, tokens: int, ttft_fast: int, ttft_slow: int, kv_used: int) -> str:
    f = "dynamo_frontend"
    return f"""
# TYPE {f}_requests counter
{f}_requests_total{{model="m",endpoint="chat_completions",request_type="stream",status="success"}} {requests}
{f}_requests_total{{model="m",endpoint="chat_completions",request_type="stream",status="error"}} 1
# TYPE {f}_inflight_requests gauge
{f}_inflight_requests{{model="m"}} 3
# TYPE {f}_output_sequence_tokens histogram
{f}_output_sequence_tokens_bucket{{model="m",le="+Inf"}} {requests}
{f}_output_sequence_tokens_sum{{model="m"}} {tokens}
{f}_output_sequence_tokens_count{{model="m"}} {requests}
# TYPE {f}_time_to_first_token_seconds histogram
{f}_time_to_first_token_seconds_bucket{{model="m",le="0.01"}} {ttft_fast}
{f}_time_to_first_token_seconds_bucket{{model="m",le="0.1"}} {ttft_fast + ttft_slow}
{f}_time_to_first_token_seconds_bucket{{model="m",le="+Inf"}} {ttft_fast + ttft_slow}
{f}_time_to_first_token_seconds_sum{{model="m"}} 1.0
{f}_time_to_first_token_seconds_count{{model="m"}} {ttft_fast + ttft_slow}
# TYPE {f}_router_reported_active_blocks gauge
{f}_router_reported_active_blocks{{model="m",pool="decode",worker_id="aa",dp_rank="0"}} {kv_used}
# TYPE {f}_router_kv_capacity_blocks gauge
{f}_router_kv_capacity_blocks{{model="m",pool="decode",worker_id="aa",dp_rank="0"}} 1000
# TYPE {f}_router_reported_waiting_requests gauge
{f}_router_reported_waiting_requests{{model="m",pool="decode",worker_id="aa",dp_rank="0"}} 2
# TYPE {f}_router_reported_running_requests gauge
{f}_router_reported_running_requests{{model="m",pool="decode",worker_id="aa",dp_rank="0"}} 5
# TYPE {f}_router_queue_depth gauge
{f}_router_queue_depth{{model="m",pool="decode"}} 4
"""


def _sample(at: float, requests: int, first: Counter[str], between: Counter[str], metrics: str) -> Sample:
    records = [
        ProcessRecord("frontend-0", "frontend", 0, "local", "ready", revision=2),
        ProcessRecord("backend-0", "backend", 0, "local", "ready", restarts=1, revision=2),
        ProcessRecord("backend-1", "backend", 1, "local", "starting", revision=2),
        ProcessRecord("etcd", "etcd", 0, "local", "ready"),
    ]
    answers = {"aa": Answers(requests, 0, first, between)}
    return Sample(at, PLAN, records, {"backend-0": "aa"}, answers, {"frontend": parse_metrics(metrics)}, {})


BEFORE = _sample(100.0, 10, Counter({"10.0": 10}), Counter({"1.0": 90}), _metrics(11, 100, 10, 0, 100))
AFTER = _sample(
    102.0,
    30,
    Counter({"10.0": 12, "50.0": 18}),
    Counter({"1.0": 190, "5.0": 100}),
    _metrics(31, 500, 12, 18, 250),
)


def test_rates_and_percentiles_are_over_the_interval():
    t = table(BEFORE, AFTER)
    rows = {r.name: r for r in t.rows}
    assert [r.kind for r in t.rows] == ["frontend", "worker", "worker", "service"]
    worker = rows["backend-0"]
    assert worker.instance == "aa" and worker.requests_per_s == 10.0  # 20 requests in 2 s
    # 20 first responses in the interval: 2 under 10 ms, 18 under 50 ms
    assert worker.ttft_p50_ms == 50.0 and worker.ttft_p90_ms == 50.0
    assert worker.itl_p50_ms == 1.0 and worker.itl_p90_ms == 5.0  # 100 of 200 gaps under 1 ms
    assert worker.tokens_per_s == (20 + 200) / 2
    assert worker.kv_usage == 0.25 and worker.inflight == 7 and worker.queue == 2
    assert (worker.restarts, worker.revision) == (1, 2)
    assert rows["backend-1"].requests_per_s is None and rows["backend-1"].instance is None
    frontend = rows["frontend-0"]
    assert frontend.requests_per_s == 10.0 and frontend.tokens_per_s == 200.0
    assert frontend.inflight == 3 and frontend.queue == 4
    assert frontend.ttft_p50_ms == 100.0  # 18 of the 20 new TTFTs were over 10 ms
    (model,) = t.models
    assert model.model == "m" and model.requests_per_s == 10.0 and model.errors_per_s == 0.0
    assert model.ttft_p90_ms == 100.0 and model.tokens_per_s == 200.0


def test_without_a_previous_sample_only_gauges_show():
    t = table(None, AFTER)
    rows = {r.name: r for r in t.rows}
    assert rows["backend-0"].requests_per_s is None and rows["backend-0"].kv_usage == 0.25
    assert rows["frontend-0"].ttft_p50_ms is None and rows["frontend-0"].inflight == 3


def test_sorting_and_filtering():
    rows = table(BEFORE, AFTER).rows
    assert [r.name for r in arrange(rows, "requests_per_s", descending=True)] == [
        "frontend-0",
        "backend-0",
        "backend-1",  # unknown values last
        "etcd",
    ]
    assert [r.name for r in arrange(rows, "name", pattern="^back")] == ["backend-0", "backend-1"]
    assert [r.name for r in arrange(rows, "name", pattern="starting")] == ["backend-1"]
    assert [r.name for r in arrange(rows, "name", pattern="(")] == []  # a bad regex is plain text


def test_keys_sort_reverse_filter_and_quit():
    view = View()
    view.key("s")
    assert view.sort == "component" and not view.descending
    for ch in "sss":
        view.key(ch)
    assert view.sort == "requests_per_s" and view.descending
    view.key("r")
    assert not view.descending
    for ch in "/bx\x7fa\r":
        view.key(ch)
    assert view.pattern == "ba" and view.typing is None
    view.key("/")
    view.key("q")  # typed into the filter, not quitting
    view.key("\x1b")
    assert view.pattern == "ba" and not view.done
    view.key("c")
    view.key("q")
    assert view.pattern == "" and view.done


def test_rendering_shows_every_process_and_the_model():
    console = Console(width=160, record=True)
    console.print(render(table(BEFORE, AFTER), View()))
    text = console.export_text()
    for name in ("frontend-0", "backend-0", "backend-1", "etcd", "25%", "10.0"):
        assert name in text


def test_a_graph_that_never_ran_is_an_error(tmp_path: Path):
    console = Console(record=True, width=200)
    state = StateDir.of(tmp_path / "graph.yaml")
    assert top(state, console, once=True, as_json=True, interval_s=0.2, view=View()) == 2
    assert "has never run" in console.export_text()
