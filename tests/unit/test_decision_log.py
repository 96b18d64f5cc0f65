"""The JSON lines writer (rotation, bounds) and the router's decision log, without processes."""

from __future__ import annotations

import json
from pathlib import Path

from dynamo_graph.llm.protocol import KvTransferParams, PreprocessedRequest
from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.decisions import DecisionLog
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.jsonl import JsonLines


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rotates_past_its_size_and_keeps_the_newest_files(tmp_path: Path):
    path = tmp_path / "out" / "log.jsonl"  # its folder is made
    writer = JsonLines(path, max_bytes=200, keep=2, flush_s=0.01)
    for i in range(30):
        writer.write({"i": i, "pad": "x" * 20})  # 35 bytes a line: 5 to a file
    writer.close()
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["log.jsonl", "log.jsonl.1", "log.jsonl.2"]
    assert all(p.stat().st_size <= 200 for p in path.parent.iterdir())
    newest = [*lines(path.with_name("log.jsonl.2")), *lines(path.with_name("log.jsonl.1")), *lines(path)]
    assert [r["i"] for r in newest] == list(range(15, 30))  # in order, the oldest dropped
    assert writer.written == 30 and writer.dropped == 0


def test_without_kept_files_the_log_starts_over(tmp_path: Path):
    path = tmp_path / "log.jsonl"
    writer = JsonLines(path, max_bytes=100, keep=0, flush_s=0.01)
    for i in range(20):
        writer.write({"i": i})  # 8 bytes a line, 9 from 10 on: 0-11 fill 98 bytes
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]
    assert [r["i"] for r in lines(path)] == list(range(12, 20))


def test_more_than_its_bound_waiting_is_dropped_and_counted(tmp_path: Path):
    writer = JsonLines(tmp_path / "log.jsonl", max_pending=3, flush_s=60)  # nothing drained meanwhile
    for i in range(5):
        writer.write({"i": i})
    assert writer.dropped == 2
    writer.close()  # the queued three are written on close
    assert [r["i"] for r in lines(tmp_path / "log.jsonl")] == [0, 1, 2]


def test_appends_to_an_existing_log(tmp_path: Path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"i": -1}\n')
    writer = JsonLines(path)
    writer.write({"i": 0})
    writer.close()
    assert [r["i"] for r in lines(path)] == [-1, 0]


def test_a_kv_decision_names_every_candidate_with_its_cost_terms(tmp_path: Path):
    path = tmp_path / "decisions.jsonl"
    config = RouterConfig(mode="kv", cost="dynamo", decision_log=str(path))
    log = DecisionLog(config)
    router = KvRouter(16, config, seed=0)
    prompt = list(range(100))
    router.route("earlier", prompt, [0xA, 0xB])  # booked on one worker: its in-flight prefix
    terms: list[dict] = []
    choice = router.route("r1", [*prompt, 7], [0xA, 0xB], explain=terms)
    context = Context("r1")
    context.migrations = 1
    log.pool("m", prefill=False, kv=True).record(
        context,
        PreprocessedRequest("m", [*prompt, 7]),
        terms,
        choice.key[0],
        choice.key[1],
        queue_wait_s=0.002,
    )
    log.close()
    (line,) = lines(path)
    assert line["request_id"] == "r1" and line["model"] == "m" and line["pool"] == "agg"
    assert line["mode"] == "kv" and line["cost"] == "dynamo" and line["isl"] == 101
    assert line["chosen"] == f"{choice.key[0]:x}" and line["dp_rank"] == 0
    assert line["queue_wait_ms"] == 2.0 and line["migrations"] == 1
    by_worker = {c["worker"]: c for c in line["candidates"]}
    assert set(by_worker) == {"a", "b"}
    holder = by_worker[line["chosen"]]  # the worker holding the earlier request's 6 full blocks
    assert holder["overlap_blocks"] == 6 and holder["new_tokens"] == 101 - 96
    assert holder["queued_tokens"] == 100 and holder["decode_blocks"] == 7
    other = by_worker["b" if line["chosen"] == "a" else "a"]
    assert other["overlap_blocks"] == 0 and other["new_tokens"] == 101 and other["queued_tokens"] == 0
    assert holder["cost"] < other["cost"]


def test_pools_and_picker_decisions(tmp_path: Path):
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(RouterConfig(mode="random", decision_log=str(path)))
    decode = log.pool("m", prefill=False, kv=False)
    prefill = log.pool("m", prefill=True, kv=False)
    request = PreprocessedRequest("m", [1, 2, 3])
    prefill.picked(Context("p"), request, None)([1, 2], 2)
    follow = PreprocessedRequest(
        "m", [1, 2, 3, 4], kv_transfer_params=KvTransferParams("ns", "prefill", 1, "t", 3, "mocker")
    )
    decode.picked(Context("p"), follow, {3})([1, 2], 1)
    log.close()
    first, second = lines(path)
    assert (first["pool"], second["pool"]) == ("prefill", "decode")
    assert first["mode"] == "random" and first["cost"] is None
    assert first["candidates"] == [{"worker": "1"}, {"worker": "2"}] and first["chosen"] == "2"
    assert second["excluded"] == ["3"] and second["queue_wait_ms"] is None
