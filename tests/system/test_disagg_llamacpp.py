"""Disaggregated prefill/decode with real KV transfer: a llama.cpp prefill worker and a llama.cpp
decode worker, each its own process, against the same model aggregated, through the openai
client. The prompt's llama.cpp sequence state travels worker to worker over the request plane."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.support.disagg_cluster import LONG, start_disagg
from tests.support.processes import ServerProcess

if os.environ.get("CI"):
    import llama_cpp  # noqa: F401 - CI installs the llamacpp extra: a missing package must fail, not skip
else:
    pytest.importorskip("llama_cpp")

ENGINE_ARGS = {"n_threads": 1, "n_batch": 64}
PROMPT_LOG = re.compile(
    r"(\d+) prompt tokens, (\d+) from (a KV handoff|the context's cache), (\d+) evaluated"
)


def varied_prompts() -> list[str]:
    """20 completion prompts of 1 to about 150 words, from different offsets of a long text."""
    words = (LONG * 2).split()
    lengths = [1, 2, 3, 5, 8, 12, 17, 23, 30, 38, 47, 57, 68, 80, 93, 107, 115, 125, 140, 150]
    return [" ".join(words[i % 9 : i % 9 + n]) for i, n in enumerate(lengths)]


def completions(base_url: str, model: str, prompts: list[str], max_tokens: int) -> list[tuple[str, int, int]]:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    answers = []
    for prompt in prompts:
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert resp.usage is not None and resp.choices[0].finish_reason == "length"
        answers.append((resp.choices[0].text, resp.usage.prompt_tokens, resp.usage.completion_tokens))
    return answers


def test_one_prefill_and_one_decode_worker_answer_as_the_aggregated_model(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_LOG", "info,dynamo_graph.engines.llamacpp=debug")
    args_file = tmp_path / "aggregated.json"
    args_file.write_text(json.dumps(ENGINE_ARGS))
    aggregated = ServerProcess(
        ["out=llamacpp", "--model-path", str(tiny_model), "--extra-engine-args", str(args_file)],
        log_dir=tmp_path,
    )
    # llama.cpp publishes no KV events: the kv router predicts from what it routed.
    cluster = start_disagg(
        tmp_path,
        tiny_model,
        prefill=1,
        decode=1,
        # No health checks: their 1-token requests would show in the decode worker's prompt loads
        # whenever it sat idle (a loaded machine).
        frontend_args=("--use-kv-events", "false", "--health-check-interval-s", "0"),
        engine="llamacpp",
        engine_args=ENGINE_ARGS,
    )
    try:
        aggregated.wait_ready(timeout=60)
        prompts = varied_prompts()
        expected = completions(aggregated.base_url, cluster.model, prompts, 16)
        assert max(n for _, n, _ in expected) > 150  # several prompts span several batches of 64
        got = completions(cluster.frontend.base_url, cluster.model, prompts, 16)
        assert got == expected
        # Every prompt was prefilled remotely and its KV fetched and loaded by the decode worker.
        assert cluster.metric("dynamo_frontend_disagg_prefill_total", where="remote") == 20
        assert cluster.metric("dynamo_frontend_kv_transfer_bytes_count") == 20
        assert cluster.metric("dynamo_frontend_kv_transfer_failures_total") == 0
        assert cluster.metric("dynamo_frontend_kv_transfer_bytes_sum") > 1000 * sum(n for _, n, _ in expected)
    finally:
        cluster.stop()
        aggregated.stop()
    # The decode worker evaluated the first token of each request and none of its prompt; the
    # prefill worker evaluated the prompts.
    (decode,) = cluster.decode
    loads = [m.groups() for m in PROMPT_LOG.finditer(decode.log())]
    assert [(int(n), int(k), src, int(e)) for n, k, src, e in loads] == [
        (n + 1, n, "a KV handoff", 1) for _, n, _ in expected
    ]
    (prefill,) = cluster.prefill
    prefilled = [m.groups() for m in PROMPT_LOG.finditer(prefill.log())]
    assert [int(n) for n, *_ in prefilled] == [n for _, n, _ in expected]
    assert all(src == "the context's cache" for _, _, src, _ in prefilled)
