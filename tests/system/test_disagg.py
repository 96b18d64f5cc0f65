"""Disaggregated prefill/decode end to end with mocker workers, each its own process, over the
embedded planes: a frontend with kv routing, prefill workers that hand the prompt's KV over,
decode workers that fetch it from them (worker to worker) and generate the rest."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.disagg_cluster import LONG, DisaggCluster, start_disagg
from tests.support.processes import ServerProcess, WorkerProcess
from tests.support.streaming import StreamResult, completion_body, run_one, stream_completion
from tests.support.waiting import wait_for, wait_for_async


@pytest.fixture
def clusters(tmp_path: Path, tiny_model: Path):
    made: list[DisaggCluster] = []

    def make(**kw: Any) -> DisaggCluster:
        cluster = start_disagg(tmp_path, tiny_model, **kw)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()


def changed(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return [i for i in after if after[i] != before.get(i, 0)]


def test_prompts_go_to_the_prefill_pool_by_kv_and_decode_fetches_their_kv(clusters, tmp_path: Path) -> None:
    decisions = tmp_path / "decisions.jsonl"
    cluster = clusters(prefill=2, decode=2, frontend_args=("--router-decision-log", str(decisions)))
    base = cluster.frontend.base_url
    # A long prompt is prefilled remotely; the same prefix again lands on the prefill worker
    # that holds it (its KV events told the prefill pool's router).
    before = cluster.sent("prefill_instances")
    first = run_one(base, completion_body(cluster.model, LONG + "Question 0?", 12))
    assert first.complete(12), first
    (holder,) = changed(before, cluster.sent("prefill_instances"))
    wait_for(
        lambda: cluster.metric("dynamo_frontend_router_indexed_blocks", pool="prefill") > 0,
        10,
        "the prefill worker's stored events to reach the frontend",
    )
    for i in range(1, 4):
        before = cluster.sent("prefill_instances")
        again = run_one(base, completion_body(cluster.model, LONG + f"Question {i}?", 12))
        assert again.complete(12), again
        assert changed(before, cluster.sent("prefill_instances")) == [holder]
    assert cluster.metric("dynamo_frontend_disagg_prefill_total", where="remote") == 4
    # Every remote prefill's KV was fetched by a decode worker (no local fallback).
    assert cluster.metric("dynamo_frontend_kv_transfer_bytes_count") == 4
    assert cluster.metric("dynamo_frontend_kv_transfer_failures_total") == 0
    # Usage is the request's own: every completion token, the first (prefill's) included.
    assert first.usage is not None and first.usage["completion_tokens"] == 12
    # The decision log: each request routed twice, its prefill (to the holder, after the first)
    # and its continuation on the decode pool.
    wait_for(lambda: decisions.exists() and len(decisions.read_text().splitlines()) >= 8, 10, "8 decisions")
    lines = [json.loads(line) for line in decisions.read_text().splitlines()]
    pools: dict[str, list[str]] = {}
    for line in lines:
        pools.setdefault(line["request_id"], []).append(line["pool"])
    assert len(pools) == 4 and all(p == ["prefill", "decode"] for p in pools.values()), pools
    assert [line["chosen"] for line in lines if line["pool"] == "prefill"][1:] == [holder] * 3


def test_conditional_disagg_keeps_what_the_decode_pool_has_cached_local(clusters) -> None:
    cluster = clusters(
        prefill=1, decode=1, frontend_args=("--router-conditional-disagg", "--max-local-prefill-length", "64")
    )
    base = cluster.frontend.base_url
    long_prompt = run_one(base, completion_body(cluster.model, LONG + "Question 0?", 8))
    assert long_prompt.complete(8), long_prompt
    assert cluster.metric("dynamo_frontend_disagg_prefill_total", where="remote") == 1
    wait_for(
        lambda: cluster.metric("dynamo_frontend_router_indexed_blocks", pool="decode") > 0,
        10,
        "the decode worker's stored events (of the imported prompt) to reach the frontend",
    )
    # A short prompt, and a follow-up whose long prefix the decode worker now holds, stay local.
    for prompt in ("Hi", LONG + "Question 1?"):
        before = cluster.sent("prefill_instances")
        result = run_one(base, completion_body(cluster.model, prompt, 8))
        assert result.complete(8), result
        assert changed(before, cluster.sent("prefill_instances")) == []
    assert cluster.metric("dynamo_frontend_disagg_prefill_total", where="local", reason="short_prompt") == 2


def test_a_request_that_ends_at_its_first_token_needs_no_decode_worker(clusters) -> None:
    cluster = clusters(prefill=1, decode=1)
    before = cluster.sent("instances")
    one = run_one(cluster.frontend.base_url, completion_body(cluster.model, LONG, 1))
    assert one.complete(1), one
    assert changed(before, cluster.sent("instances")) == []
    assert cluster.metric("dynamo_frontend_kv_transfer_bytes_count") == 0


async def _load(base: str, bodies: list[dict[str, Any]], during) -> list[StreamResult]:
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(60.0), limits=httpx.Limits(max_connections=64)
    ) as http:
        sem = asyncio.Semaphore(8)

        async def one(body: dict[str, Any]) -> StreamResult:
            async with sem:
                return await stream_completion(http, base, body)

        tasks = [asyncio.create_task(one(b)) for b in bodies]
        await during()
        return await asyncio.gather(*tasks)


def test_kill9_of_a_prefill_worker_under_load_loses_no_request(clusters) -> None:
    # Slow mockers (~0.5 s a request, ~2.5 s for all): the kill lands mid-load.
    cluster = clusters(prefill=2, decode=2, speedup=0.5)
    bodies = [completion_body(cluster.model, LONG + f"Ticket {i}.", 24) for i in range(40)]
    killed_at: list[float] = []

    def busiest() -> WorkerProcess | None:
        """The prefill worker the router has sent the most requests (the router may favour one)."""
        sent = cluster.sent("prefill_instances")
        loaded = [w for w in cluster.prefill if sent.get(w.instance() or "", 0) > 0]
        return max(loaded, key=lambda w: sent[w.instance() or ""], default=None)

    async def kill_soon() -> None:
        await wait_for_async(lambda: busiest() is not None, 20, "requests on a prefill worker to kill")
        victim = busiest()
        assert victim is not None
        victim.kill9()
        killed_at.append(time.perf_counter())

    results = asyncio.run(_load(cluster.frontend.base_url, bodies, kill_soon))
    ended_at = time.perf_counter()
    bad = [r for r in results if not r.complete(24)]
    assert not bad, bad[:3]
    # The load went on well past the kill; every request was prefilled somewhere.
    assert ended_at > killed_at[0] + 0.5
    remote = cluster.metric("dynamo_frontend_disagg_prefill_total", where="remote")
    local = cluster.metric("dynamo_frontend_disagg_prefill_total", where="local")
    assert remote + local == 40 and remote >= 1


def test_without_prefill_workers_requests_are_local_and_enforce_says_503(
    clusters, tmp_path: Path, tiny_model: Path
) -> None:
    cluster = clusters(prefill=1, decode=1)
    enforcing = ServerProcess(
        ["out=auto", "--router-mode", "kv", "--enforce-disagg"], env=cluster.env, log_dir=tmp_path
    )
    try:
        enforcing.wait_ready(path="/live", timeout=60)
        wait_for(
            lambda: run_one(enforcing.base_url, completion_body(cluster.model, LONG, 4)).complete(4),
            30,
            "enforcing frontend serves",
        )
        # The prefill pool empties (its worker stops and leaves discovery).
        (worker,) = cluster.prefill
        assert worker.stop() == 0, worker.log()
        wait_for(lambda: not cluster.sent("prefill_instances"), 30, "the prefill pool to empty")
        local = run_one(cluster.frontend.base_url, completion_body(cluster.model, LONG, 8))
        assert local.complete(8), local
        assert (
            cluster.metric("dynamo_frontend_disagg_prefill_total", where="local", reason="no_prefill_worker")
            == 1
        )

        def refused() -> bool:
            answer = run_one(enforcing.base_url, completion_body(cluster.model, LONG, 4))
            return answer.status == 503 and "prefill" in answer.body

        wait_for(refused, 30, "the enforcing frontend to refuse with 503")
        body = httpx.post(
            f"{enforcing.base_url}/v1/completions",
            json={"model": cluster.model, "prompt": LONG, "max_tokens": 4},
            timeout=30,
        )
        assert body.status_code == 503
        assert "--enforce-disagg" in body.json()["error"]["message"]
    finally:
        enforcing.stop()


def test_a_kv_transfer_that_cannot_be_fetched_is_prefilled_locally(clusters) -> None:
    # The prefill worker drops every handoff at once: the decode worker's fetch finds nothing.
    cluster = clusters(prefill=1, decode=1, prefill_env={"DYN_KV_TRANSFER_TTL_S": "0.000001"})
    result = run_one(cluster.frontend.base_url, completion_body(cluster.model, LONG, 10))
    assert result.complete(10), result
    assert cluster.metric("dynamo_frontend_disagg_prefill_total", where="remote") == 1
    assert cluster.metric("dynamo_frontend_kv_transfer_failures_total", kind="fetch_failed") == 1
    assert cluster.metric("dynamo_frontend_kv_transfer_bytes_count") == 0
    assert "prefilling locally" in cluster.decode[0].log()


def test_kill9_of_the_decode_worker_mid_stream_migrates_through_prefill_again(clusters) -> None:
    cluster = clusters(prefill=1, decode=2, speedup=0.5)
    before = cluster.sent("instances")
    killed: list[str] = []

    def kill_serving_decode_worker(chunks: int) -> None:
        if chunks == 5 and not killed:
            (serving,) = changed(before, cluster.sent("instances"))
            killed.append(serving)
            victim = next(w for w in cluster.decode if w.instance() == serving)
            victim.kill9()

    result = run_one(
        cluster.frontend.base_url, completion_body(cluster.model, LONG, 40), kill_serving_decode_worker
    )
    assert killed and result.complete(40), result
    # The continuation was prefilled remotely again, then decoded by the surviving worker.
    assert cluster.metric("dynamo_frontend_disagg_prefill_total", where="remote") == 2
    assert cluster.metric("dynamo_frontend_model_migration_total") == 1
