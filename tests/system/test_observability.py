"""Seeing a running graph work (issue 30): the router's decision log, the frontend's recording
replayed by `dyngraph bench`, `dyngraph top`, each worker's own /metrics, and a real Prometheus
scraping every process. One graph for the module: the CI graph
mocker-kv.yaml (two mocker workers, kv routing) under `dyngraph up`, its frontend writing a
decision log and a recording; the official `openai` client sends a few requests."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.local_graph import Graph, Traffic
from tests.support.processes import DYNGRAPH, run_cli
from tests.support.prometheus import (
    active_targets,
    dashboard_expressions,
    needs_prometheus,
    scraping,
    wait_for_data,
)
from tests.support.routing import opening_messages, served_by
from tests.support.waiting import wait_for

MODEL = "tiny-model"


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Graph]:
    tmp = tmp_path_factory.mktemp("observe")
    graph = Graph("mocker-kv.yaml", tmp, tiny_model)
    try:
        up = graph.up(
            f"+components.frontend.router.decision_log={tmp / 'decisions.jsonl'}",
            f"+components.frontend.record.path={tmp / 'recorded.jsonl'}",
        )
        assert up.returncode == 0, up.stdout + up.stderr
        yield graph
    finally:
        graph.cli("down", timeout=90)


def _lines(path: Path) -> list[dict]:
    """The whole lines written so far (a line being appended right now is left for later)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def _client(graph: Graph) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{graph.port}/v1", api_key="none", max_retries=0, timeout=30
    )


def test_each_request_has_one_decision_naming_the_worker_that_served_it(graph: Graph) -> None:
    log = graph.file.parent / "decisions.jsonl"
    client = _client(graph)
    start = time.time()  # lines of earlier tests' requests may still be on their way
    served = []
    for conv in range(4):  # two conversations, each asked twice: kv routing keeps them home
        messages = opening_messages(conv % 2)

        def send(m: list[dict] = messages) -> dict:
            return client.chat.completions.create(model=MODEL, messages=m, max_tokens=4).model_dump()

        worker, _ = served_by(graph, MODEL, send)  # type: ignore[arg-type]
        served.append(worker)

    def mine() -> list[dict]:
        return [d for d in _lines(log) if d["ts"] >= start]

    wait_for(lambda: len(mine()) >= 4, 10, "the decision log's lines")
    decisions = mine()
    assert len(decisions) == 4
    assert [d["chosen"] for d in decisions] == served
    assert len({d["request_id"] for d in decisions}) == 4
    for d in decisions:
        assert d["model"] == MODEL and d["pool"] == "agg" and d["mode"] == "kv" and d["migrations"] == 0
        assert len(d["candidates"]) == 2 and d["chosen"] in {c["worker"] for c in d["candidates"]}
        assert {"overlap_blocks", "new_tokens", "queued_tokens", "decode_blocks", "cost"} <= set(
            d["candidates"][0]
        )
    # The repeated conversations found their prefix cached where they went.
    repeat = max(c["overlap_blocks"] for c in decisions[2]["candidates"])
    assert repeat >= 3 and decisions[2]["chosen"] == decisions[0]["chosen"]


def test_a_recorded_trace_replays_with_the_same_requests_and_tokens(graph: Graph, tiny_model: Path) -> None:
    recorded = graph.file.parent / "recorded.jsonl"
    client = _client(graph)
    start_ms = time.time() * 1000
    for i in range(3):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Request {i}: " + "tell me more " * (20 * i + 1)}],
            max_tokens=3 + i,
            extra_body={"nvext": {"ignore_eos": True}},
        )
        client.completions.create(model=MODEL, prompt=f"Once upon a time {i}", max_tokens=5)

    def mine() -> list[dict]:
        return [r for r in _lines(recorded) if r["timestamp"] >= start_ms]

    wait_for(lambda: len(mine()) >= 6, 10, "the recording's lines")
    rows = mine()
    assert len(rows) == 6 and {r["api"] for r in rows} == {"chat_completions", "completions"}
    assert all(r["model"] == MODEL and "messages" not in r and "prompt" not in r for r in rows)
    assert [r["output_length"] for r in rows] == [3, 5, 4, 5, 5, 5]
    trace = graph.file.parent / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = graph.file.parent / "replay"
    url = f"http://127.0.0.1:{graph.port}"
    words = (
        f"bench --url {url} --trace {trace} --tokenizer {tiny_model} --trace-speedup 10 -o {out} --no-plots"
    )
    done = run_cli(words.split(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(next(out.glob("*.json")).read_text())["points"][0]["summary"]
    assert summary["ok"] == summary["requests"] == 6
    assert summary["prompt_tokens"] == sum(r["input_length"] for r in rows)
    assert summary["output_tokens"] == sum(r["output_length"] for r in rows)


def test_top_once_json_has_a_row_per_process_with_live_rates(graph: Graph) -> None:
    with Traffic(graph):
        done = run_cli(["top", str(graph.file), "--once", "--json", "--interval", "1"], timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    view = json.loads(done.stdout)
    rows = {r["name"]: r for r in view["processes"]}
    assert set(rows) == set(graph.processes())
    assert all(r["state"] == "ready" for r in rows.values())
    assert rows["frontend-0"]["requests_per_s"] > 0 and rows["frontend-0"]["tokens_per_s"] > 0
    workers = [rows["backend-0"], rows["backend-1"]]
    assert all(w["instance"] for w in workers)
    assert sum(w["requests_per_s"] or 0 for w in workers) > 0
    (model,) = view["models"]
    assert model["model"] == MODEL and model["requests_per_s"] > 0 and model["ttft_p90_ms"] is not None


@pytest.mark.serial  # times itself: run alone, not beside other test workers
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_top_in_tmux_moves_under_load_sorts_filters_and_quits_on_q(graph: Graph) -> None:
    session = f"dyngraph-top-{os.getpid()}"
    command = shlex.join([*DYNGRAPH, "top", str(graph.file)])
    tmux = ["tmux", "-L", session]  # a server of its own: nothing else's sessions are touched
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "150",
            "-y",
            "40",
            f"{command}; echo TOP-EXITED $?; sleep 30",
        ],
        check=True,
        env={**os.environ, "TERM": "xterm-256color"},
    )

    def screen() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
        ).stdout

    def keys(*words: str) -> None:
        subprocess.run([*tmux, "send-keys", "-t", session, *words], check=True)

    try:
        wait_for(lambda: "frontend-0" in screen(), 30, "top's table")
        with Traffic(graph):
            frames = []
            for _ in range(3):
                time.sleep(1.2)
                frames.append(next(line for line in screen().splitlines() if "frontend-0" in line))
        assert all(name in screen() for name in graph.processes())
        assert len(set(frames)) > 1, frames  # its numbers moved
        keys("/")
        keys("-l", "backend")
        keys("Enter")
        wait_for(lambda: "filter: backend" in screen() and "frontend-0" not in screen(), 5, "the filter")
        keys("q")
        wait_for(lambda: "TOP-EXITED 0" in screen(), 10, "top to quit on q")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def _worker_targets(graph: Graph) -> dict[str, str]:
    """Worker process -> HOST:PORT of its /metrics, from `render -f prometheus`."""
    rendered = run_cli(["render", str(graph.file), "-f", "prometheus", *graph.overrides])
    assert rendered.returncode == 0, rendered.stderr
    configs = [s for job in yaml.safe_load(rendered.stdout)["scrape_configs"] for s in job["static_configs"]]
    return {s["labels"]["process"]: s["targets"][0] for s in configs if "process" in s["labels"]}


def test_every_worker_serves_its_requests_and_the_mockers_series_on_its_own_metrics(graph: Graph) -> None:
    targets = _worker_targets(graph)
    assert sorted(targets) == ["backend-0", "backend-1"]

    def scrape() -> dict[str, dict[tuple[str, tuple], float]]:
        out = {}
        for process, target in targets.items():
            text = httpx.get(f"http://{target}/metrics", timeout=5).text
            out[process] = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            }
        return out

    def served(samples: dict[tuple[str, tuple], float]) -> float:
        key = ("dyngraph_worker_requests_total", (("model", MODEL), ("status", "served")))
        return samples[key]

    before = scrape()
    client = _client(graph)
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"count me {i}", max_tokens=2)
    wait_for(
        lambda: sum(map(served, scrape().values())) >= sum(map(served, before.values())) + 3,
        10,
        "the workers counting the requests they served",
    )
    for samples in scrape().values():
        assert samples[("dyngraph_mocker_kv_blocks_total", (("dp_rank", "0"),))] == 4096
        assert ("dyngraph_mocker_prefix_cache_hit_tokens_total", (("dp_rank", "0"),)) in samples
        assert samples[("dyngraph_worker_max_inflight", (("model", MODEL),))] == 1024


@needs_prometheus
def test_prometheus_scrapes_every_target_and_every_dashboard_expression_has_data(graph: Graph) -> None:
    exprs = dashboard_expressions(graph)
    assert len(exprs) >= 10
    with scraping(graph) as api:
        scraped = {t["labels"].get("process") for t in active_targets(api)}
        assert scraped == {None, "backend-0", "backend-1"}  # the frontend, each worker replica's own
        with Traffic(graph):
            wait_for_data(api, exprs, 30)
