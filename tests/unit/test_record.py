"""The frontend's recording: trace lines bench/workload.py replays, text only when asked."""

from __future__ import annotations

import json
from pathlib import Path

from dynamo_graph.bench.workload import trace, words_vocabulary
from dynamo_graph.frontend.record import Recorder
from dynamo_graph.frontend.settings import RecordSettings
from dynamo_graph.llm.openai import CompletionRequest
from dynamo_graph.llm.pipeline import Prepared
from dynamo_graph.llm.protocol import PreprocessedRequest, RoutingHints


def _prepared(prompt: list[int], completion: int, session: str | None = None) -> Prepared:
    request = CompletionRequest(model="m", prompt="some text")
    pre = PreprocessedRequest("m", prompt, routing=RoutingHints(session_id=session))
    return Prepared(request, pre, prompt_tokens=len(prompt), completion_tokens=completion)


def test_lines_are_a_trace_whose_shared_prefixes_share_hash_ids(tmp_path: Path):
    path = tmp_path / "rec.jsonl"
    recorder = Recorder(RecordSettings(path=str(path), block_size=4))
    shared = list(range(100, 108))  # two whole blocks
    for i, (tail, n) in enumerate([([1, 2, 3], 5), ([9, 9, 9, 9, 9], 7)]):
        prepared = _prepared(shared + tail, n, session="s1")
        recorder.record(1000.0 + i / 10, "completions", prepared, prepared.request)
    recorder.close()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["timestamp"] == 1_000_000 and second["timestamp"] == 1_000_100
    assert (first["input_length"], first["output_length"]) == (11, 5)
    assert len(first["hash_ids"]) == 2 and second["hash_ids"][:2] == first["hash_ids"]
    assert len(second["hash_ids"]) == 3  # its own third block
    assert first["session_id"] == "s1" and first["model"] == "m" and "prompt" not in first
    replayed = trace(words_vocabulary(), path, block_size=4)
    assert [(len(p.ids), p.max_tokens) for p in replayed] == [(11, 5), (13, 7)]
    assert replayed[0].ids[:8] == replayed[1].ids[:8] and replayed[1].at == 0.1


def test_text_only_when_asked(tmp_path: Path):
    path = tmp_path / "rec.jsonl"
    recorder = Recorder(RecordSettings(path=str(path), record_text=True))
    prepared = _prepared([1, 2, 3], 2)
    recorder.record(1.0, "completions", prepared, prepared.request)
    recorder.close()
    assert json.loads(path.read_text())["prompt"] == "some text"
