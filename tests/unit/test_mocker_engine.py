"""The mocker behind the LLMEngine contract: settings, streams, timing, KV events, lifecycle."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from dynamo_graph.backend.errors import EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines import create_engine, get_engine_spec
from dynamo_graph.engines.mocker.args import MockerArgs, MockerArgsError, args_from_settings
from dynamo_graph.engines.mocker.engine import MockerEngine
from dynamo_graph.engines.mocker.perf_model import PolynomialPerfModel
from dynamo_graph.engines.mocker.scheduler import mock_token_ids
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.protocols import LoadMetrics, StoredBlock
from dynamo_graph.runtime.context import Context

FAST = 1e9  # speedup_ratio: simulated time vanishes
VOCAB = 5000


class RecordingSink:
    """A KvEventSink that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.loads: list[LoadMetrics] = []
        self.lora_names: list[str | None] = []  # of each stored event, in order

    def stored(
        self,
        parent_hash: int | None,
        blocks: Sequence[StoredBlock],
        dp_rank: int = 0,
        lora_name: str | None = None,
    ) -> None:
        self.events.append(("stored", parent_hash, list(blocks), dp_rank))
        self.lora_names.append(lora_name)

    def removed(self, block_hashes: Sequence[int], dp_rank: int = 0) -> None:
        self.events.append(("removed", list(block_hashes), dp_rank))

    def cleared(self, dp_rank: int = 0) -> None:
        self.events.append(("cleared", dp_rank))

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)


@pytest.fixture
async def make_engine() -> AsyncIterator:
    engines: list[MockerEngine] = []

    async def make(sink: RecordingSink | None = None, worker_id: int = 7, **kw: object) -> MockerEngine:
        kw.setdefault("speedup_ratio", FAST)
        engine = MockerEngine(MockerArgs(**kw), vocab_size=VOCAB, reserved_token_ids=[0, 1, 2])  # type: ignore[arg-type]
        engine.kv_event_sink = sink
        await engine.start(worker_id)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.cleanup()


def request(tokens: Sequence[int], max_tokens: int | None = 8, **kw: object) -> PreprocessedRequest:
    stop = StopConditions(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return PreprocessedRequest(model="mock", token_ids=list(tokens), stop_conditions=stop)


async def collect(
    engine: MockerEngine, req: PreprocessedRequest, ctx: Context | None = None
) -> list[LLMEngineOutput]:
    return [out async for out in engine.generate(req, ctx or Context())]


def ids(outs: list[LLMEngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


# ---- settings --------------------------------------------------------------------------------


def test_unknown_extra_engine_args_key_is_rejected_with_the_known_keys() -> None:
    with pytest.raises(MockerArgsError) as err:
        MockerArgs.from_dict({"block_size": 16, "num_gpu_block": 10})
    msg = str(err.value)
    assert "'num_gpu_block'" in msg
    for key in MockerArgs.known_keys():
        assert key in msg
    assert isinstance(err.value, RunConfigError)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"block_size": "16"}, "block_size must be an integer"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks must be at least 1"),
        ({"max_num_seqs": True}, "max_num_seqs must be an integer"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching must be true or false"),
        ({"watermark": 1.0}, "watermark must be within [0, 1)"),
        ({"speedup_ratio": 0}, "speedup_ratio must be greater than 0"),
        ({"speedup_ratio": "fast"}, "speedup_ratio must be a number"),
        ({"max_model_len": 0}, "max_model_len must be at least 1"),
    ],
)
def test_bad_values_are_named_by_key(data: dict, needle: str) -> None:
    with pytest.raises(MockerArgsError, match=None) as err:
        MockerArgs.from_dict(data)
    assert needle in str(err.value)


def test_flags_and_extra_engine_args_combine_but_must_not_conflict(tmp_path: Path) -> None:
    path = tmp_path / "mocker.json"
    path.write_text(json.dumps({"num_gpu_blocks": 100, "block_size": 16, "speedup_ratio": 5}))
    args = args_from_settings(EngineSettings(extra_engine_args=path, context_length=256))
    assert (args.num_gpu_blocks, args.block_size, args.speedup_ratio, args.max_model_len) == (100, 16, 5, 256)
    assert args_from_settings(EngineSettings(extra_engine_args=path, kv_cache_block_size=16)).block_size == 16
    assert args_from_settings(EngineSettings(kv_cache_block_size=32)).block_size == 32
    with pytest.raises(MockerArgsError, match="--kv-cache-block-size 32 conflicts with block_size=16"):
        args_from_settings(EngineSettings(extra_engine_args=path, kv_cache_block_size=32))


def test_max_model_len_must_fit_the_kv_cache() -> None:
    with pytest.raises(MockerArgsError, match="max_model_len 1000 is more than the KV cache"):
        MockerEngine(MockerArgs(block_size=4, num_gpu_blocks=100, max_model_len=1000))
    # derived from the model: lowered to what fits under the watermark (99 blocks of 4)
    assert (
        MockerEngine(MockerArgs(block_size=4, num_gpu_blocks=100), default_max_model_len=1000).max_model_len
        == 396
    )
    with pytest.raises(MockerArgsError, match="max_num_batched_tokens"):
        MockerEngine(MockerArgs(max_model_len=9000, enable_chunked_prefill=False))


async def test_from_config_uses_the_model_and_reports_the_engine_config(
    tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "mocker.json"
    path.write_text(json.dumps({"num_gpu_blocks": 64, "block_size": 16, "dp_size": 2, "speedup_ratio": FAST}))
    cfg = EngineSettings(engine="mocker", model_path=str(tiny_model), extra_engine_args=path)
    model = resolve_model(str(tiny_model))
    assert get_engine_spec("mocker").needs_model
    engine = create_engine("mocker", cfg, model)
    assert isinstance(engine, MockerEngine) and engine.publishes_kv_events
    try:
        config = await engine.start(3)
        assert config.model_input == "tokens"
        assert (config.kv_cache_block_size, config.total_kv_blocks) == (16, 64)
        assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)
        assert config.context_length == model.context_length == 512
        assert config.data_parallel_size == 2
        outs = await collect(engine, request([10, 11, 12], max_tokens=None))
        generated = ids(outs)
        assert len(generated) == 512 - 3 and outs[-1].finish_reason == "length"
        # never the tokenizer's special tokens (ids 0-5 here) nor eos
        assert not set(generated) & {0, 1, 2, 3, 4, 5}
        assert max(generated) < model.load_tokenizer().get_vocab_size()
    finally:
        await engine.cleanup()


# ---- streams ---------------------------------------------------------------------------------


async def test_stream_shape_and_determinism(make_engine) -> None:
    engine = await make_engine()
    prompt = list(range(3, 40))
    outs = await collect(engine, request(prompt, max_tokens=6))
    assert all(len(o.token_ids) == 1 for o in outs) and len(outs) == 6
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert outs[0].cached_tokens == 0
    usage = outs[-1].completion_usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (37, 6)
    assert ids(outs) == mock_token_ids(prompt, 6, vocab_size=VOCAB, reserved=[0, 1, 2])
    assert ids(await collect(engine, request(prompt, max_tokens=6))) == ids(outs)
    seeded = request(prompt, max_tokens=6)
    seeded.sampling_options = SamplingOptions(seed=42)
    assert ids(await collect(engine, seeded)) != ids(outs)


async def test_max_tokens_none_runs_to_max_model_len(make_engine) -> None:
    engine = await make_engine(max_model_len=64, block_size=4)
    outs = await collect(engine, request(range(3, 13), max_tokens=None))
    assert len(ids(outs)) == 54 and outs[-1].finish_reason == "length"
    outs = await collect(engine, request(range(3, 13), max_tokens=1000))
    assert len(ids(outs)) == 54


async def test_stop_token_ids_min_tokens_and_eos(make_engine) -> None:
    engine = await make_engine()
    prompt = [5, 6, 7]
    stream = mock_token_ids(prompt, 40, vocab_size=VOCAB, reserved=[0, 1, 2])
    stop = stream[3]
    first = stream.index(stop)
    outs = await collect(engine, request(prompt, max_tokens=40, stop_token_ids=[stop]))
    assert ids(outs) == stream[: first + 1] and outs[-1].finish_reason == "stop"
    outs = await collect(engine, request(prompt, max_tokens=40, stop_token_ids=[stop], min_tokens=first + 1))
    assert len(ids(outs)) > first + 1
    # eos ids are never generated, with or without ignore_eos: generation runs to max_tokens
    eos = stream[:5]
    for ignore in (False, True):
        req = request(prompt, max_tokens=300, stop_token_ids_hidden=eos[:2], ignore_eos=ignore)
        req.eos_token_ids = eos[2:]
        got = ids(await collect(engine, req))
        assert len(got) == 300 and not set(got) & set(eos)


async def test_invalid_requests_name_the_field(make_engine) -> None:
    engine = await make_engine(max_model_len=64, block_size=4, dp_size=2)
    cases = [
        (request(range(3, 67)), "prompt"),
        (request([]), "prompt"),
        (request([3, VOCAB]), "token_ids"),
        (request([3], max_tokens=0), "max_tokens"),
        (PreprocessedRequest(model="m", token_ids=[3], dp_rank=2), "dp_rank"),
    ]
    for req, param in cases:
        with pytest.raises(InvalidArgument) as err:
            await collect(engine, req)
        assert err.value.param == param, err.value.message
    with pytest.raises(InvalidArgument, match="the prompt has 64 tokens; this worker's max_model_len 64"):
        await collect(engine, request(range(3, 67)))


# ---- timing ----------------------------------------------------------------------------------


@pytest.mark.serial  # times itself: run alone, not beside other test workers
async def test_time_follows_the_perf_model_within_ten_percent(make_engine) -> None:
    speedup, prompt_len, max_tokens, bs, blocks = 2.0, 2000, 100, 64, 16384
    engine = await make_engine(speedup_ratio=speedup)
    model = PolynomialPerfModel()
    # the formula, independently: one prefill pass, then max_tokens - 1 decode passes; during the
    # decode of generated token k the sequence holds ceil((prompt + k) / block_size) blocks
    prefill_ms = 4.209989e-07 * prompt_len**2 + 1.518344e-02 * prompt_len + 16.50142
    assert model.prefill_ms(prompt_len) == pytest.approx(prefill_ms)
    decode_ms = 0.0
    for k in range(1, max_tokens):
        p = math.ceil((prompt_len + k) / bs) / blocks
        decode_ms += max(1.0, -25.74 * p * p + 54.01 * p + 5.74)
    expected_s = (prefill_ms + decode_ms) / speedup / 1000

    start = time.perf_counter()
    first = None
    async for _ in engine.generate(request(range(3, 3 + prompt_len), max_tokens=max_tokens), Context()):
        if first is None:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    assert first is not None
    assert prefill_ms / speedup / 1000 * 0.9 <= first <= prefill_ms / speedup / 1000 + 0.01
    assert expected_s * 0.9 <= total <= expected_s * 1.1, (total, expected_s)


async def test_a_huge_speedup_takes_no_time_but_yields_to_the_loop(make_engine) -> None:
    engine = await make_engine(speedup_ratio=FAST)
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    outs = await collect(engine, request(range(3, 2003), max_tokens=500))
    elapsed = time.perf_counter() - start
    stop.set()
    await task
    assert len(outs) == 500 and elapsed < 1.0
    assert ticks > 100


@pytest.mark.serial  # times itself: run alone, not beside other test workers
async def test_decodes_are_batched(make_engine) -> None:
    """16 concurrent requests take about as long as one: one decode pass serves them all."""
    engine = await make_engine(speedup_ratio=20.0)
    start = time.perf_counter()
    await collect(engine, request([3, 4, 5], max_tokens=40))
    one = time.perf_counter() - start
    start = time.perf_counter()
    await asyncio.gather(*(collect(engine, request([3 + i, 4, 5], max_tokens=40)) for i in range(16)))
    many = time.perf_counter() - start
    assert many < one * 1.6, (one, many)


# ---- KV events and load ----------------------------------------------------------------------


async def test_kv_events_and_load_metrics_reach_the_sink(make_engine) -> None:
    sink = RecordingSink()
    engine = await make_engine(sink, block_size=4, num_gpu_blocks=6, watermark=0.0, max_model_len=24)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks
    outs = await collect(engine, request(prompt, max_tokens=3))
    gen = ids(outs)
    local = local_block_hashes(prompt + gen[:2], 4)
    seqh = sequence_hashes(local)
    blocks = [StoredBlock(s, h) for s, h in zip(seqh, local, strict=True)]
    assert sink.events == [("stored", None, blocks[:2], 0), ("stored", seqh[1], [blocks[2]], 0)]
    # a second identical prompt hits the cache for its first 2 blocks
    outs2 = await collect(engine, request(prompt, max_tokens=3))
    assert outs2[0].cached_tokens == 8 and outs2[-1].completion_usage.cached_tokens == 8
    # a 6-block prompt needs every block: the 3 cached ones are evicted, tail first
    sink.events.clear()
    await collect(engine, request(range(100, 124 - 1), max_tokens=1))
    assert sink.events[0] == ("removed", [seqh[2], seqh[1], seqh[0]], 0)
    assert sink.events[1][0] == "stored"
    await asyncio.sleep(0.01)  # the rank publishes its idle load after delivering
    last = sink.loads[-1]
    assert last == LoadMetrics(worker_id=7, active_blocks=0, total_blocks=6, waiting=0, running=0, dp_rank=0)
    assert any(m.running == 1 and m.active_blocks > 0 for m in sink.loads)
    await engine.cleanup()
    assert sink.events[-1] == ("cleared", 0)


async def test_data_parallel_ranks_are_separate_caches(make_engine) -> None:
    sink = RecordingSink()
    engine = await make_engine(sink, block_size=4, dp_size=2)
    prompt = list(range(3, 12))
    req = request(prompt, max_tokens=2)
    req.dp_rank = 1
    await collect(engine, req)
    assert {ev[-1] for ev in sink.events} == {1}
    req0 = request(prompt, max_tokens=2)
    req0.dp_rank = 0
    outs = await collect(engine, req0)
    assert outs[0].cached_tokens == 0  # rank 0 has not seen the prompt
    req1 = request(prompt, max_tokens=2)
    req1.dp_rank = 1
    assert (await collect(engine, req1))[0].cached_tokens == 8
    # without dp_rank, concurrent requests spread over the least loaded ranks
    sink.events.clear()
    await asyncio.gather(*(collect(engine, request([50 + i] * 9, max_tokens=2)) for i in range(2)))
    assert sorted(ev[-1] for ev in sink.events if ev[0] == "stored") == [0, 1]


# ---- cancellation and lifecycle --------------------------------------------------------------


async def test_a_stopped_context_ends_the_stream_and_frees_blocks(make_engine) -> None:
    engine = await make_engine(speedup_ratio=1.0, block_size=4)
    ctx = Context()
    outs = []
    async for out in engine.generate(request(range(3, 40), max_tokens=1000), ctx):
        outs.append(out)
        if len(outs) == 3:
            ctx.stop_generating()
    assert outs[-1].finish_reason == "cancelled" and not outs[-1].token_ids
    assert outs[-1].completion_usage.completion_tokens >= 3
    assert len(outs) <= 6
    sched = engine._ranks[0].scheduler
    assert sched.kv.used == 0 and not sched.has_work()


async def test_abort_and_a_consumer_going_away_free_blocks(make_engine) -> None:
    engine = await make_engine(speedup_ratio=1.0, block_size=4)
    sched = engine._ranks[0].scheduler
    ctx = Context()
    gen = engine.generate(request(range(3, 40), max_tokens=1000), ctx)
    await gen.__anext__()
    assert sched.kv.used > 0
    await engine.abort(ctx)
    rest = [out async for out in gen]
    assert rest[-1].finish_reason == "cancelled"
    assert sched.kv.used == 0

    gen = engine.generate(request(range(3, 40), max_tokens=1000), Context())
    await gen.__anext__()
    await gen.aclose()
    for _ in range(50):
        if not sched.has_work():
            break
        await asyncio.sleep(0.005)
    assert sched.kv.used == 0 and not sched.has_work()
    await asyncio.wait_for(engine.drain(), 1.0)


async def test_a_context_stopped_before_the_request_is_not_scheduled(make_engine) -> None:
    engine = await make_engine()
    ctx = Context()
    ctx.stop_generating()
    outs = await collect(engine, request([3, 4], max_tokens=5), ctx)
    assert [o.finish_reason for o in outs] == ["cancelled"]


async def test_cleanup_is_idempotent_safe_without_start_and_ends_streams() -> None:
    await MockerEngine().cleanup()
    engine = MockerEngine(MockerArgs(speedup_ratio=1.0))
    await engine.start()
    gen = engine.generate(request([3, 4, 5], max_tokens=10_000), Context())
    await gen.__anext__()
    await engine.cleanup()
    with pytest.raises(EngineShutdown):
        async for _ in gen:
            pass
    await engine.cleanup()
    assert all(rank.task.done() for rank in engine._ranks)
    with pytest.raises(EngineShutdown):
        await collect(engine, request([3]))


async def test_drain_waits_for_in_flight_requests(make_engine) -> None:
    engine = await make_engine(speedup_ratio=50.0)
    task = asyncio.create_task(collect(engine, request([3, 4, 5], max_tokens=30)))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(engine.drain(), 2.0)
    assert task.done() and task.result()[-1].finish_reason == "length"


async def test_prefill_hands_over_and_decode_continues_without_prefilling(make_engine) -> None:
    """Disaggregated P/D on two mockers: the prefill engine returns the first token and a handoff
    of the prompt; the decode engine imports the prompt's blocks (stored events) and computes
    only the first token after them, as one decode step."""
    from dynamo_graph.backend.engine import KvImportError
    from dynamo_graph.backend.kv_transfer import KvHandoff

    sink = RecordingSink()
    prefill = await make_engine(worker_id=1, block_size=16, kv_bytes_per_token=1000)
    decode = await make_engine(sink, worker_id=2, block_size=16, kv_bytes_per_token=1000)
    prompt = list(range(100, 150))  # 3 full blocks and 2 tokens
    first, handoff = await prefill.prefill(request(prompt, max_tokens=8), Context())
    assert len(first.token_ids) == 1 and first.finish_reason is None and handoff is not None
    assert (handoff.num_tokens, handoff.size) == (50, 50_000)
    follow = request([*prompt, *first.token_ids], max_tokens=7)
    outs = [o async for o in decode.generate_from_kv(follow, handoff, Context())]
    assert sum(len(o.token_ids) for o in outs) == 7 and outs[-1].finish_reason == "length"
    stored = [e for e in sink.events if e[0] == "stored"]
    # The first stored event is the import: the prompt's 3 full blocks, before any compute.
    assert stored and stored[0][1] is None and len(stored[0][2]) == 3
    assert outs[0].cached_tokens == 48  # every full prompt block was present at admission
    with pytest.raises(KvImportError, match="cannot be loaded"):
        await anext(decode.generate_from_kv(follow, KvHandoff("other/1", 50, handoff.data), Context()))
    with pytest.raises(KvImportError, match="not this request's prompt"):
        await anext(decode.generate_from_kv(request([1, *prompt[1:]]), handoff, Context()))
    # A request that ends at its first token comes back finished, with nothing to hand over.
    done, nothing = await prefill.prefill(request(prompt, max_tokens=1), Context())
    assert done.finish_reason == "length" and nothing is None


async def test_a_handed_over_adapter_prompt_is_imported_as_the_adapters_blocks(make_engine) -> None:
    """The decode worker imports an adapter request's prompt as that adapter's blocks (seeded
    hashes, stored events naming it), so the request finds them, as a base-model one does."""
    from dynamo_graph.backend.lora import LoraAdapter, lora_id
    from dynamo_graph.router.kv.hashing import lora_hash_seed

    sink = RecordingSink()
    prefill = await make_engine(worker_id=1, block_size=16)
    decode = await make_engine(sink, worker_id=2, block_size=16)
    for engine in (prefill, decode):
        await engine.load_lora(LoraAdapter("sql", "/adapters/sql", lora_id("sql")))
    prompt = list(range(100, 150))
    asked = request(prompt, max_tokens=8)
    asked.model = "sql"
    first, handoff = await prefill.prefill(asked, Context())
    assert handoff is not None
    follow = request([*prompt, *first.token_ids], max_tokens=7)
    follow.model = "sql"
    outs = [o async for o in decode.generate_from_kv(follow, handoff, Context())]
    assert outs[0].cached_tokens == 48
    imported = sink.events[0]
    assert imported[0] == "stored" and sink.lora_names[0] == "sql"
    assert [b.tokens_hash for b in imported[2]] == local_block_hashes(prompt, 16, lora_hash_seed("sql"))
