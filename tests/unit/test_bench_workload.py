"""`dyngraph bench`'s workloads, statistics and sweep variants, without a server: prompts are
token-exact with the tiny model's real tokenizer, traces keep their prefix sharing and timing,
and bad input is refused naming the cause."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import sys
from pathlib import Path

import pytest

from dynamo_graph.bench import plots, stats, workload
from dynamo_graph.bench.graphs import sweep_variants
from dynamo_graph.bench.loadgen import Run
from dynamo_graph.bench.report import variant_label
from dynamo_graph.bench.stream import Result


@pytest.fixture(scope="module")
def vocab(tokenizer_dir: Path) -> workload.Vocabulary:
    assert workload.vocab_range(tokenizer_dir)[0] > 0
    return workload.tokenizer_vocabulary(tokenizer_dir)


def test_synthetic_prompts_have_exact_lengths_in_ordinary_ids(vocab: workload.Vocabulary) -> None:
    prompts = workload.synthetic(vocab, count=20, input_len=37, output_len=9, seed=3)
    low, high = vocab.low, vocab.high
    assert [len(p.ids) for p in prompts] == [37] * 20
    assert all(p.max_tokens == 9 for p in prompts)
    assert all(low <= i < high for p in prompts for i in p.ids)
    assert low > 0  # the special tokens (eos, bos) are never drawn
    # seeded: the same workload for every point and variant
    again = workload.synthetic(vocab, count=20, input_len=37, output_len=9, seed=3)
    assert [p.ids for p in prompts] == [p.ids for p in again]


def test_shared_prefix_workload(vocab: workload.Vocabulary) -> None:
    prompts = workload.synthetic(vocab, count=9, input_len=40, output_len=4, prefix_len=32, num_prefixes=3)
    prefixes = [tuple(p.ids[:32]) for p in prompts]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6] and prefixes[0] != prefixes[1]
    assert len({tuple(p.ids[32:]) for p in prompts}) == 9  # every suffix its own


def test_chat_bodies_are_text_and_completions_are_ids(vocab: workload.Vocabulary) -> None:
    prompts = workload.synthetic(vocab, count=2, input_len=16, output_len=5)
    completions = workload.to_requests(prompts, vocab, api="completions", model="m", ignore_eos=True)
    assert completions[0].body["prompt"] == prompts[0].ids
    assert completions[0].body["ignore_eos"] is True and completions[0].body["stream"] is True
    chat = workload.to_requests(prompts, vocab, api="chat", model="m", ignore_eos=False)
    assert isinstance(chat[0].body["messages"][0]["content"], str) and "ignore_eos" not in chat[0].body
    words = workload.words_vocabulary()
    plain = workload.to_requests(prompts, words, api="completions", model="m", ignore_eos=True)
    assert isinstance(plain[0].body["prompt"], str) and not words.exact


def test_mooncake_trace_keeps_prefix_sharing_and_timing(vocab: workload.Vocabulary, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 20, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 15, "output_length": 4, "hash_ids": [7, 9]},
        {"timestamp": 3000, "input_length": 30, "output_length": 5, "hash_ids": [7]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = workload.trace(vocab, trace, block_size=10, speedup=2.0)
    assert [len(p.ids) for p in prompts] == [20, 15, 30]
    assert [p.max_tokens for p in prompts] == [3, 4, 5]
    assert [p.at for p in prompts] == [0.0, 0.25, 1.0]  # ms from the first line, twice as fast
    assert prompts[0].ids[:10] == prompts[1].ids[:10] == prompts[2].ids[:10]  # hash id 7
    assert prompts[0].ids[10:20] != prompts[1].ids[10:15] + prompts[0].ids[15:20]
    assert len(workload.trace(vocab, trace, block_size=10, limit=2)) == 2


def test_a_bad_trace_line_is_named(vocab: workload.Vocabulary, tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 5}\n')
    with pytest.raises(workload.WorkloadError, match=r"bad.jsonl:2: .*input_length"):
        workload.trace(vocab, trace)
    trace.write_text('{"timestamp": 0, "input_length": 0, "output_length": 2}\n')
    with pytest.raises(workload.WorkloadError, match=r"bad.jsonl:1: input_length and output_length"):
        workload.trace(vocab, trace)
    with pytest.raises(workload.WorkloadError, match="prefix length"):
        workload.synthetic(vocab, count=1, input_len=8, output_len=1, prefix_len=9)


def test_poisson_arrivals_have_the_rate(vocab: workload.Vocabulary) -> None:
    prompts = workload.synthetic(vocab, count=2000, input_len=1, output_len=1)
    timed = workload.poisson(prompts, rate=50.0, seed=1)
    gaps = [b.at - a.at for a, b in itertools.pairwise(timed)]
    assert timed[0].at == 0.0 and all(g > 0 for g in gaps)
    assert 0.018 < statistics.mean(gaps) < 0.022  # 1/50 s
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.15)  # exponential


def test_summary_percentiles_and_throughput() -> None:
    rng = random.Random(0)
    results = [
        Result(
            i,
            ok=True,
            start=i * 0.1,
            ttft=0.01 * (i + 1),
            total=0.01 * (i + 1) + 0.09,
            output_tokens=10,
            prompt_tokens=5,
        )
        for i in range(100)
    ]
    for r in results:
        r.gaps = [rng.uniform(0.001, 0.003) for _ in range(9)]
    results.append(Result(100, ok=False, error="HTTP 503"))
    summary = stats.summarize(Run(results, wall_s=10.0))
    assert (summary["requests"], summary["ok"], summary["failed"]) == (101, 100, 1)
    assert summary["errors"] == ["HTTP 503"]
    assert summary["requests_per_s"] == 10.0 and summary["output_tokens_per_s"] == 100.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(505.0)
    assert summary["ttft_ms"]["p99"] == pytest.approx(990.1)
    assert 1.0 <= summary["itl_ms"]["p50"] <= 3.0
    assert summary["tpot_ms"]["p50"] == pytest.approx(10.0)  # 90 ms for the 9 tokens after the first
    assert summary["e2e_ms"]["p50"] == pytest.approx(595.0)
    line = stats.timeline(results, 10.0 + 1.0)
    assert len(line["t_s"]) == 20  # five requests a bin at least
    assert sum(v * (11.0 / 20) for v in line["requests_per_s"]) == pytest.approx(100, rel=1e-3)


def test_sweep_variants_are_the_cartesian_product() -> None:
    assert sweep_variants([]) == [[]]
    assert sweep_variants(["a.b=1,2", "c=x,y"]) == [
        ["a.b=1", "c=x"],
        ["a.b=1", "c=y"],
        ["a.b=2", "c=x"],
        ["a.b=2", "c=y"],
    ]
    for bad in ("novalue", "k=", "k=1,,2", "=1"):
        with pytest.raises(ValueError, match="KEY=V1,V2"):
            sweep_variants([bad])
    assert variant_label(["components.frontend.router.mode=kv", "x=1"]) == "router.mode=kv x=1"


def test_plots_without_matplotlib_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    with pytest.raises(plots.PlotsUnavailable, match=r"pip install -e '\.\[plot\]'"):
        plots.pyplot()


def test_each_load_point_gets_fresh_prompts_unless_asked_to_reuse_them(tokenizer_dir: Path) -> None:
    from dynamo_graph.bench.measure import Load, Settings, prepare

    loads = [Load("closed", 1), Load("closed", 8), Load("open", 5.0)]
    base = Settings(loads=loads, requests=12, input_len=64, prefix_len=32, num_prefixes=2, warmup=4)
    fresh = prepare(Settings(**{**vars(base), "tokenizer": tokenizer_dir}))
    ids = [{tuple(p.ids) for p in point} for point in fresh.points]
    prefixes = [{tuple(p.ids[:32]) for p in point} for point in fresh.points]
    assert all(len(point) == 12 for point in fresh.points)
    for a, b in itertools.combinations(range(3), 2):
        assert not ids[a] & ids[b] and not prefixes[a] & prefixes[b]  # shared prefixes too
    assert not {tuple(p.ids) for p in fresh.warmup} & set().union(*ids)  # the warm-up warms nothing
    assert len({workload.digest(point) for point in fresh.points}) == 3
    # the first point's are what they were before points got their own: the seed's
    again = prepare(Settings(**{**vars(base), "tokenizer": tokenizer_dir}))
    assert [p.ids for p in again.points[0]] == [p.ids for p in fresh.points[0]]

    reused = prepare(Settings(**{**vars(base), "tokenizer": tokenizer_dir, "reuse_prompts": True}))
    assert all(point == reused.points[0] for point in reused.points)
    assert [p.ids for p in reused.points[0]] == [p.ids for p in fresh.points[0]]
    assert reused.warmup == reused.points[0][:4]
