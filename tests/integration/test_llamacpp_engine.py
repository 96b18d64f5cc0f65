"""`out=llamacpp`: real llama.cpp on the tiny model's GGUF, behind the engine contract (KV transfer
between two engines included) and through the whole `dyngraph run in=http` stack with the official
`openai` client."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_graph.backend.engine import KvImportError
from dynamo_graph.backend.errors import EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, SamplingOptions
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.engines import create_engine, get_engine_spec
from dynamo_graph.engines.llamacpp.args import INSTALL_HINT, LlamaCppArgs, LlamaCppError
from dynamo_graph.engines.llamacpp.engine import LlamaCppEngine
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.llm.protocol import RoutingHints
from dynamo_graph.router.migration import continuation
from dynamo_graph.runtime.context import Context
from tests.support.engine_requests import collect, greedy_request, ids, llama_greedy_reference, stream_chat
from tests.support.processes import ServerProcess, run_cli

if os.environ.get("CI"):
    import llama_cpp  # CI installs the llamacpp extra: a missing package must fail, not skip
else:
    llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far away, there lived",
    "it's 12345 $3.14",
    "Hello",
]


@pytest.fixture(scope="module")
def token_ids(tiny_model: Path) -> list[list[int]]:
    tok = resolve_model(str(tiny_model)).load_tokenizer()
    return [tok.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Iterator[Callable[[list[int], int], list[int]]]:
    """llama.cpp's own greedy `Llama.generate` (fresh state each call)."""
    with llama_greedy_reference(tiny_model / GGUF_NAME) as generate:
        yield generate


@pytest.fixture
async def make_engine(tiny_model: Path) -> AsyncIterator[Callable[..., Awaitable[LlamaCppEngine]]]:
    engines: list[LlamaCppEngine] = []

    async def make(**args: Any) -> LlamaCppEngine:
        engine = LlamaCppEngine(
            tiny_model / GGUF_NAME, LlamaCppArgs.from_dict(args), default_n_ctx=512, tokenizer_vocab_size=2048
        )
        engines.append(engine)
        await engine.start()
        return engine

    yield make
    for engine in engines:
        await engine.cleanup()


request = functools.partial(greedy_request, eos_token_ids=[4])


# ---- the engine directly -------------------------------------------------------------------------


async def test_greedy_matches_llama_generate_and_is_deterministic(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    engine = await make_engine()
    assert engine.config().model_input == "tokens"
    assert engine.config().context_length == 512
    for prompt in token_ids:
        outs = await collect(engine, request(prompt, 24))
        assert ids(outs) == reference(prompt, 24)
        final = outs[-1]
        assert final.finish_reason == "length"
        assert all(out.finish_reason is None for out in outs[:-1])
        assert final.completion_usage is not None
        assert final.completion_usage.prompt_tokens == len(prompt)
        assert final.completion_usage.completion_tokens == 24
    # Again, now with each context's KV cache holding the previous request: same tokens.
    for prompt in token_ids:
        assert ids(await collect(engine, request(prompt, 24))) == reference(prompt, 24)


async def test_prefix_reuse_reports_cached_tokens_and_changes_nothing(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    engine = await make_engine()
    first = token_ids[0]
    outs = await collect(engine, request(first, 8))
    assert outs[0].cached_tokens == 0
    # A follow-up turn: the previous prompt and answer, then more.
    follow = [*first, *ids(outs), *token_ids[1]]
    outs = await collect(engine, request(follow, 12))
    assert outs[0].cached_tokens == len(first) + 7  # the answer's last token was never evaluated
    assert outs[-1].completion_usage is not None
    assert outs[-1].completion_usage.cached_tokens == len(first) + 7
    assert ids(outs) == reference(follow, 12)
    # The same prompt again: all but its last token come from the cache.
    outs = await collect(engine, request(follow, 12))
    assert outs[0].cached_tokens == len(follow) - 1
    assert ids(outs) == reference(follow, 12)

    fresh = await make_engine(prefix_reuse=False)
    await collect(fresh, request(first, 8))
    outs = await collect(fresh, request(first, 8))
    assert outs[0].cached_tokens == 0
    assert ids(outs) == reference(first, 8)


async def test_stop_token_ids_eos_ignore_eos_and_min_tokens(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    engine = await make_engine()
    prompt = token_ids[0]
    expected = reference(prompt, 24)
    stop = expected[2]
    upto = expected[: expected.index(stop) + 1]

    outs = await collect(engine, request(prompt, 24, stop_token_ids=[stop]))
    assert ids(outs) == upto  # the stop token ends the stream (the postprocessor hides it)
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].completion_usage.completion_tokens == len(upto)  # type: ignore[union-attr]

    # An eos id (hidden stop) stops too, unless ignore_eos.
    outs = await collect(engine, request(prompt, 24, stop_token_ids_hidden=[stop]))
    assert ids(outs) == upto and outs[-1].finish_reason == "stop"
    outs = await collect(engine, request(prompt, 24, stop_token_ids_hidden=[stop], ignore_eos=True))
    assert ids(outs) == expected and outs[-1].finish_reason == "length"

    # min_tokens: the stop ids cannot be sampled before then.
    outs = await collect(engine, request(prompt, 24, stop_token_ids=[stop], min_tokens=len(upto) + 2))
    got = ids(outs)
    assert stop not in got[: len(upto) + 2]
    assert len(got) > len(upto)
    assert outs[-1].finish_reason in ("stop", "length")
    if outs[-1].finish_reason == "stop":
        assert got[-1] == stop

    outs = await collect(engine, request(prompt, 1))
    assert ids(outs) == expected[:1] and outs[-1].finish_reason == "length"


async def test_context_limits(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]]
) -> None:
    engine = await make_engine(n_ctx=64)
    assert engine.config().context_length == 64
    long_prompt = (token_ids[0] * 4)[:60]
    outs = await collect(engine, request(long_prompt, None))
    assert len(ids(outs)) == 4 and outs[-1].finish_reason == "length"  # prompt + output = n_ctx
    outs = await collect(engine, request(long_prompt, 100))
    assert len(ids(outs)) == 4 and outs[-1].finish_reason == "length"
    with pytest.raises(InvalidArgument, match="maximum context length is 64"):
        await collect(engine, request(token_ids[0] * 3, 4))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        await collect(engine, request([1, 2, 99999], 4))
    with pytest.raises(InvalidArgument, match="empty"):
        await collect(engine, request([], 4))
    with pytest.raises(InvalidArgument, match="guided"):
        await collect(engine, request([1, 2], 4, sampling=SamplingOptions(guided_regex="a+")))


async def test_sampling_with_a_seed_is_reproducible(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]]
) -> None:
    engine = await make_engine()
    prompt = token_ids[1]

    async def sample(seed: int) -> list[int]:
        opts = SamplingOptions(temperature=1.5, top_p=0.95, top_k=50, min_p=0.01, seed=seed)
        return ids(await collect(engine, request(prompt, 32, sampling=opts)))

    a, b, c = await sample(1), await sample(1), await sample(2)
    assert a == b and len(a) == 32
    assert a != c
    penalised = SamplingOptions(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5)
    plain = ids(await collect(engine, request(prompt, 32)))
    assert ids(await collect(engine, request(prompt, 32, sampling=penalised))) != plain


async def test_cancel_mid_stream_and_abort(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    engine = await make_engine()
    prompt = token_ids[0]
    for how in ("stop", "abort"):
        ctx = Context()
        outs: list[LLMEngineOutput] = []
        async for out in engine.generate(request(prompt, 480), ctx):
            outs.append(out)
            if len(outs) == 1:
                if how == "stop":
                    ctx.stop_generating()
                else:
                    await engine.abort(ctx)
        assert outs[-1].finish_reason == "cancelled"
        usage = outs[-1].completion_usage
        assert usage is not None and usage.completion_tokens == len(ids(outs)) < 480
    # The context serves the next request as if fresh.
    assert ids(await collect(engine, request(prompt, 16))) == reference(prompt, 16)
    # Stopped before it starts.
    ctx = Context()
    ctx.stop_generating()
    outs = await collect(engine, request(prompt, 16), ctx)
    assert [o.finish_reason for o in outs] == ["cancelled"] and not ids(outs)


async def test_a_consumer_that_goes_away_frees_its_context(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    engine = await make_engine(n_parallel=1)
    stream = engine.generate(request(token_ids[0], 480), Context())
    await anext(stream)
    await stream.aclose()
    outs = await asyncio.wait_for(collect(engine, request(token_ids[1], 8)), 10)
    assert ids(outs) == reference(token_ids[1], 8)
    await asyncio.wait_for(engine.drain(), 5)


@pytest.mark.parametrize("n_parallel", [1, 2])
async def test_concurrent_requests(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]],
    token_ids: list[list[int]],
    reference: Any,
    n_parallel: int,
) -> None:
    engine = await make_engine(n_parallel=n_parallel)
    assert engine.config().max_num_seqs == n_parallel
    jobs = [(token_ids[i % len(token_ids)], 8 + 9 * i) for i in range(8)]
    results = await asyncio.gather(*(collect(engine, request(p, n)) for p, n in jobs))
    for (prompt, n), outs in zip(jobs, results, strict=True):
        assert ids(outs) == reference(prompt, n)
        assert outs[-1].finish_reason == "length"
    # A request waiting for a context can be cancelled while it waits.
    if n_parallel == 1:
        busy = asyncio.ensure_future(collect(engine, request(token_ids[0], 480)))
        await asyncio.sleep(0)
        ctx = Context()
        waiting = asyncio.ensure_future(collect(engine, request(token_ids[1], 8), ctx))
        await asyncio.sleep(0)
        ctx.stop_generating()
        outs = await asyncio.wait_for(waiting, 5)
        assert outs[-1].finish_reason == "cancelled"
        assert len(ids(await busy)) == 480
    await asyncio.wait_for(engine.drain(), 5)


async def _first_token_order(
    engine: LlamaCppEngine, jobs: list[tuple[str, list[int], int | None]], gap: float = 0.01
) -> list[str]:
    """Submit `jobs` (name, prompt, priority) in order, `gap` apart; the order of their first
    tokens."""
    order: list[str] = []

    async def send(name: str, prompt: list[int], priority: int | None) -> None:
        req = request(prompt, 4)
        req.routing = None if priority is None else RoutingHints(priority=priority)
        async for out in engine.generate(req, Context()):
            if out.token_ids and name not in order:
                order.append(name)

    tasks = []
    for name, prompt, priority in jobs:
        tasks.append(asyncio.create_task(send(name, prompt, priority)))
        await asyncio.sleep(gap)  # submitted in this order
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return order


async def test_waiting_requests_take_a_free_sequence_most_urgent_first(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]]
) -> None:
    engine = await make_engine(n_parallel=1)
    busy = engine.generate(request(token_ids[0], 480), Context())
    await anext(busy)  # the one sequence is taken for a while (the three are submitted meanwhile)
    jobs = [("low0", token_ids[1], -1), ("low1", token_ids[2], None), ("high", token_ids[3], 10)]
    waiting = asyncio.create_task(_first_token_order(engine, jobs))
    rest = [out async for out in busy]
    assert rest[-1].finish_reason == "length"
    # Had the blocker ended before they queued, low0 would have gone first, as it came first.
    assert await waiting == ["high", "low1", "low0"]  # low1's priority is 0, above low0's -1
    await asyncio.wait_for(engine.drain(), 5)


@pytest.mark.parametrize(("priorities", "first"), [((0, 0), "early"), ((0, 5), "late")])
async def test_prompt_chunks_share_a_step_most_urgent_first(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]],
    token_ids: list[list[int]],
    priorities: tuple[int, int],
    first: str,
) -> None:
    """Two long prompts prefilling together in 16-token steps: the urgent one's chunks go first,
    so it gets its first token first; with equal priorities the earlier one does."""
    engine = await make_engine(n_parallel=2, n_batch=16, prefix_reuse=False)
    early, late = token_ids[0] * 16, token_ids[0][::-1] * 16  # 368 tokens: 23 steps each
    jobs = [("early", early, priorities[0]), ("late", late, priorities[1])]
    order = await _first_token_order(engine, jobs, gap=0)
    assert order[0] == first
    await asyncio.wait_for(engine.drain(), 5)


async def test_requests_decode_together_in_one_context_with_the_ids_of_one_at_a_time(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]]
) -> None:
    """20 prompts of 1 to 420 tokens on 8 sequences: each step decodes several of them in one
    llama_decode, and every request's greedy ids equal its ids when it runs alone."""
    engine = await make_engine(n_parallel=8, n_batch=64, prefix_reuse=False)
    prompts = _varied_prompts(token_ids)
    steps = engine.decode_steps
    alone = [ids(await collect(engine, request(p, 16))) for p in prompts]
    alone_steps = engine.decode_steps - steps
    steps = engine.decode_steps
    together = await asyncio.gather(*(collect(engine, request(p, 16)) for p in prompts))
    together_steps = engine.decode_steps - steps
    assert [ids(outs) for outs in together] == alone
    assert all(outs[-1].finish_reason == "length" for outs in together)
    # Alone: one step per token, plus the prompts' chunks of 64. Together: 8 sequences a step.
    assert alone_steps >= 20 * 16
    assert together_steps < alone_steps / 3
    await asyncio.wait_for(engine.drain(), 5)


async def test_a_prefix_held_by_a_busy_sequence_is_shared_not_evaluated_again(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    engine = await make_engine(n_parallel=2)
    shared = token_ids[1] * 3
    busy = engine.generate(request(shared, 480), Context())
    await anext(busy)  # sequence 0 holds the shared prompt and is generating
    follow = [*shared, *token_ids[0]]
    evaluated = engine.prompt_tokens_evaluated
    outs = await collect(engine, request(follow, 12))  # sequence 1, empty until now
    assert outs[0].cached_tokens == len(shared)
    assert engine.prompt_tokens_evaluated - evaluated == len(token_ids[0])
    assert ids(outs) == reference(follow, 12)
    # What the worker's /metrics shows of the engine (backend/metrics.py).
    (collector,) = engine.metrics_collectors()
    series = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert series["dyngraph_llamacpp_requests"] == 1  # the busy one
    assert series["dyngraph_llamacpp_max_sequences"] == 2
    assert series["dyngraph_llamacpp_prompt_tokens_evaluated_total"] == engine.prompt_tokens_evaluated
    assert series["dyngraph_llamacpp_decode_steps_total"] > 0  # the busy sequence still steps
    await busy.aclose()
    await asyncio.wait_for(engine.drain(), 5)


async def test_cleanup_is_idempotent_and_ends_streams(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], tiny_model: Path, token_ids: list[list[int]]
) -> None:
    never_started = LlamaCppEngine(tiny_model / GGUF_NAME)
    await never_started.cleanup()
    await never_started.cleanup()
    with pytest.raises(EngineShutdown):
        await never_started.start()

    engine = await make_engine(n_parallel=1)
    running = asyncio.ensure_future(collect(engine, request(token_ids[0], 480)))
    queued = asyncio.ensure_future(collect(engine, request(token_ids[1], 8)))
    await asyncio.sleep(0.01)
    await engine.cleanup()
    await engine.cleanup()
    assert (await running)[-1].finish_reason in ("cancelled", "length")
    with pytest.raises(EngineShutdown):
        await queued
    with pytest.raises(EngineShutdown):
        await collect(engine, request(token_ids[0], 4))


async def test_vocab_mismatch_and_bad_gguf(tiny_model: Path, tmp_path: Path) -> None:
    engine = LlamaCppEngine(tiny_model / GGUF_NAME, tokenizer_vocab_size=5000)
    with pytest.raises(LlamaCppError, match="vocabulary has 2048 tokens but the tokenizer has 5000"):
        await engine.start()
    await engine.cleanup()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    engine = LlamaCppEngine(bad)
    with pytest.raises(LlamaCppError, match="could not load"):
        await engine.start()
    await engine.cleanup()


# ---- building from the command line's settings -----------------------------------------------------


def test_from_config_reads_the_folder_gguf_and_settings(tiny_model: Path, tmp_path: Path) -> None:
    assert get_engine_spec("llamacpp").needs_model
    extra = tmp_path / "args.json"
    extra.write_text(json.dumps({"n_parallel": 2, "n_threads": 1, "seed": 7}))
    model = resolve_model(str(tiny_model))
    engine = create_engine("llamacpp", EngineSettings(context_length=256, extra_engine_args=extra), model)
    assert isinstance(engine, LlamaCppEngine)
    assert engine.gguf_path == tiny_model / GGUF_NAME
    assert (engine.n_ctx, engine.args.n_parallel, engine.args.seed) == (256, 2, 7)
    assert engine.args.llama_kwargs == {"n_threads": 1, "seed": 7}
    # A .gguf file as the model works the same; the model's own context length is the default.
    engine = create_engine("llamacpp", EngineSettings(), resolve_model(str(tiny_model / GGUF_NAME)))
    assert isinstance(engine, LlamaCppEngine) and engine.n_ctx == 512


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"n_paralel": 2}, "unknown llamacpp option 'n_paralel'; known options: n_parallel, n_ctx"),
        ({"n_parallel": 0}, "n_parallel must be at least 1"),
        ({"n_threads": "4"}, "n_threads must be an integer"),
        ({"use_mmap": 1}, "use_mmap must be true or false"),
        ({"n_ctx": 128}, "--context-length 256 conflicts with n_ctx=128"),
    ],
)
def test_bad_engine_args(tiny_model: Path, tmp_path: Path, args: dict[str, Any], message: str) -> None:
    extra = tmp_path / "args.json"
    extra.write_text(json.dumps(args))
    cfg = EngineSettings(context_length=256, extra_engine_args=extra)
    with pytest.raises(RunConfigError, match=message):
        create_engine("llamacpp", cfg, resolve_model(str(tiny_model)))


def _hf_only_copy(tiny_model: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "hf-only"
    folder.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, folder / f.name)
    return folder


def test_a_folder_without_gguf_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    folder = _hf_only_copy(tiny_model, tmp_path)
    with pytest.raises(LlamaCppError, match=r"holds no \.gguf file"):
        create_engine("llamacpp", EngineSettings(), resolve_model(str(folder)))
    # ... and the CLI says so as an error, not a traceback.
    result = run_cli(["run", "in=none", "out=llamacpp", str(folder)], timeout=60)
    assert result.returncode == 2, result.stderr
    assert "holds no .gguf file" in result.stderr and "Traceback" not in result.stderr


def test_missing_llama_cpp_says_how_to_install(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    hint = r"`make llamacpp` in dyngraph's checkout .*pip install -e '\.\[llamacpp\]'"
    with pytest.raises(RunConfigError, match=hint) as err:
        create_engine("llamacpp", EngineSettings(), resolve_model(str(tiny_model)))
    assert str(err.value).startswith(INSTALL_HINT)


def test_importing_dyngraph_does_not_import_llama_cpp() -> None:
    code = "import sys, dynamo_graph.engines, dynamo_graph.cli.main; print('llama_cpp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- the whole stack: dyngraph run in=http out=llamacpp, with the openai client ------------------


@pytest.fixture(scope="module")
def llama_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["out=llamacpp", "--model-path", str(tiny_model)], log_dir=tmp_path_factory.mktemp("llamacpp")
    )
    try:
        server.wait_ready(timeout=60)
        yield server
    finally:
        server.stop()


def test_http_chat_completions_with_the_openai_client(llama_server: ServerProcess, tiny_model: Path) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{llama_server.base_url}/v1", api_key="unused", max_retries=0)
    model = tiny_model.name
    messages = [{"role": "user", "content": "Tell me a story about a fox."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    assert full.usage is not None and full.usage.completion_tokens == 20 and full.usage.prompt_tokens > 5
    prompt_tokens = full.usage.prompt_tokens

    text, finish, usage = stream_chat(client, model, messages, 20)
    assert text == choice.message.content  # greedy: streaming and not give the same answer
    assert finish == "length"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 20)
    # The second identical prompt came from the context's cache (all but its last token).
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1


def test_http_completion_equals_llama_generate(
    llama_server: ServerProcess, tiny_model: Path, token_ids: list[list[int]], reference: Any
) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{llama_server.base_url}/v1", api_key="unused", max_retries=0)
    tok = resolve_model(str(tiny_model)).load_tokenizer()
    prompt = token_ids[2]
    resp = client.completions.create(model=tiny_model.name, prompt=prompt, max_tokens=16, temperature=0)
    assert resp.choices[0].text == tok.decode(reference(prompt, 16), skip_special_tokens=False)
    assert resp.usage is not None and (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (
        len(prompt),
        16,
    )
    # A prompt that leaves no room in the context is the client's 400.
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=tiny_model.name, prompt=[7] * 600, max_tokens=4)


# ---- disaggregated prefill/decode: the KV moves between two engines -----------------------------


def _varied_prompts(token_ids: list[list[int]]) -> list[list[int]]:
    """20 prompts of 1 to 420 tokens (most longer than the n_batch of 64 used below), each from
    its own offset of a long stream of text tokens."""
    stream = [t for i in range(60) for t in token_ids[(i * 3) % len(token_ids)]]
    lengths = [1, 2, 3, 7, 16, 31, 63, 64, 65, 96, 127, 128, 129, 150, 190, 256, 257, 300, 350, 420]
    return [stream[(i * 13) % 50 : (i * 13) % 50 + n] for i, n in enumerate(lengths)]


async def _from_kv(engine: LlamaCppEngine, req: Any, handoff: Any, ctx: Context | None = None) -> list[Any]:
    return [out async for out in engine.generate_from_kv(req, handoff, ctx or Context())]


async def test_prefill_on_one_engine_and_decode_on_another_equal_the_aggregated_run(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]]
) -> None:
    prefill, decode, aggregated = [await make_engine(n_batch=64) for _ in range(3)]
    assert prefill.kv_transfer and prefill.kv_format == decode.kv_format
    assert prefill.kv_format.startswith("llamacpp-state/1:gguf-")
    prompts = _varied_prompts(token_ids)
    assert len(prompts) == 20 and len(set(map(tuple, prompts))) == 20
    for i, prompt in enumerate(prompts):
        max_tokens = None if i == len(prompts) - 1 else 16  # the last one runs to the context's end
        req = request(prompt, max_tokens)
        evaluated = aggregated.prompt_tokens_evaluated
        outs = await collect(aggregated, req)
        expected = ids(outs)
        assert aggregated.prompt_tokens_evaluated - evaluated == len(prompt) - outs[0].cached_tokens
        assert len(expected) == (16 if max_tokens else 512 - len(prompt))

        first, handoff = await prefill.prefill(req, Context())
        assert first.token_ids == expected[:1]
        assert first.finish_reason is None and first.completion_usage is None
        assert handoff is not None and handoff.num_tokens == len(prompt)
        assert handoff.format == prefill.kv_format and handoff.size == len(handoff.data) > 1000 * len(prompt)

        evaluated = decode.prompt_tokens_evaluated
        outs = await _from_kv(decode, continuation(req, first.token_ids), handoff)
        assert first.token_ids + ids(outs) == expected, f"prompt {i} ({len(prompt)} tokens)"
        assert decode.prompt_tokens_evaluated - evaluated == 1  # the first token, none of the prompt
        assert outs[0].cached_tokens == len(prompt)
        assert outs[-1].finish_reason == "length"
        assert outs[-1].completion_usage == CompletionUsage(
            prompt_tokens=len(prompt) + 1, completion_tokens=len(expected) - 1, cached_tokens=len(prompt)
        )

    # Penalties count the prefill's first token as generated, as the aggregated run does.
    penalised = SamplingOptions(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5)
    req = request(prompts[5], 24, sampling=penalised)
    expected = ids(await collect(aggregated, req))
    assert expected != ids(await collect(aggregated, request(prompts[5], 24)))
    first, handoff = await prefill.prefill(req, Context())
    assert (
        first.token_ids + ids(await _from_kv(decode, continuation(req, first.token_ids), handoff)) == expected
    )


async def test_a_request_ending_at_its_first_token_hands_nothing_over(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    engine = await make_engine()
    prompt = token_ids[0]
    t0 = reference(prompt, 1)[0]
    for req, reason in [
        (request(prompt, 1), "length"),
        (request(prompt, 16, stop_token_ids=[t0]), "stop"),
        (greedy_request(prompt, 16, eos_token_ids=[t0]), "stop"),
    ]:
        out, handoff = await engine.prefill(req, Context())
        assert (out.token_ids, out.finish_reason, handoff) == ([t0], reason, None)
        assert out.completion_usage is not None and out.completion_usage.completion_tokens == 1
    # An eos that is ignored does not end it; min_tokens keeps a stop id from being sampled.
    out, handoff = await engine.prefill(
        greedy_request(prompt, 16, eos_token_ids=[t0], ignore_eos=True), Context()
    )
    assert out.token_ids == [t0] and out.finish_reason is None and handoff is not None
    out, handoff = await engine.prefill(request(prompt, 16, stop_token_ids=[t0], min_tokens=2), Context())
    assert out.token_ids != [t0] and out.finish_reason is None and handoff is not None

    ctx = Context()
    ctx.stop_generating()
    out, handoff = await engine.prefill(request(prompt, 16), ctx)
    assert (out.token_ids, out.finish_reason, handoff) == ([], "cancelled", None)


async def test_a_handoff_that_does_not_fit_is_refused_before_any_output(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    prefill, decode = await make_engine(), await make_engine()
    prompt, other = token_ids[1], token_ids[0]
    req = request(prompt, 8)
    first, handoff = await prefill.prefill(req, Context())
    assert handoff is not None
    follow = continuation(req, first.token_ids)
    replace = msgspec.structs.replace
    refused = [
        (replace(handoff, format=handoff.format.replace("gguf-", "gguf-0")), "cannot be loaded by"),
        (replace(handoff, data=handoff.data[:-100]), "could not load"),
        (replace(handoff, data=handoff.data + b"\0" * 8), "read .* of the"),
        (replace(handoff, num_tokens=handoff.num_tokens + 1), "covers .* tokens of a"),
    ]
    for bad, message in refused:
        stream = decode.generate_from_kv(follow, bad, Context())
        with pytest.raises(KvImportError, match=message):
            await anext(stream)  # raised at the first step: nothing was yielded
    with pytest.raises(KvImportError, match="not of this request's prompt"):
        await anext(
            decode.generate_from_kv(continuation(request(other, 8), first.token_ids), handoff, Context())
        )
    # A request too long for the decode worker's context is refused as generate refuses it.
    small = await make_engine(n_ctx=16)
    long_req = request((prompt * 4)[:20], 4)
    first_long, long_handoff = await prefill.prefill(long_req, Context())
    with pytest.raises(InvalidArgument, match="maximum context length is 16"):
        await anext(
            small.generate_from_kv(continuation(long_req, first_long.token_ids), long_handoff, Context())
        )

    # The failed loads left nothing behind: the same context continues from the good handoff.
    evaluated = decode.prompt_tokens_evaluated
    assert first.token_ids + ids(await _from_kv(decode, follow, handoff)) == reference(prompt, 8)
    assert decode.prompt_tokens_evaluated - evaluated == 1
    # ... and it serves ordinary requests as before.
    assert ids(await collect(decode, request(other, 8))) == reference(other, 8)


async def test_handoffs_leave_and_enter_sequences_beside_busy_ones(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    """With sequence 0 of both engines busy, the prefill exports sequence 1 of its context and
    the decode worker loads it into sequence 1 of its own."""
    prefill, decode = await make_engine(n_parallel=2), await make_engine(n_parallel=2)
    busy = [engine.generate(request(token_ids[3], 480), Context()) for engine in (prefill, decode)]
    for stream in busy:
        await anext(stream)
    prompt = token_ids[1] * 2
    req = request(prompt, 12)
    first, handoff = await prefill.prefill(req, Context())
    assert handoff is not None and handoff.num_tokens == len(prompt)
    evaluated = decode.prompt_tokens_evaluated
    outs = await _from_kv(decode, continuation(req, first.token_ids), handoff)
    assert first.token_ids + ids(outs) == reference(prompt, 12)
    assert decode.prompt_tokens_evaluated - evaluated == 1
    for stream in busy:
        await stream.aclose()


async def test_cancel_while_generating_from_kv(
    make_engine: Callable[..., Awaitable[LlamaCppEngine]], token_ids: list[list[int]], reference: Any
) -> None:
    prefill, decode = await make_engine(), await make_engine(n_parallel=1)
    prompt = token_ids[0]
    req = request(prompt, 400)
    first, handoff = await prefill.prefill(req, Context())
    ctx = Context()
    outs: list[LLMEngineOutput] = []
    async for out in decode.generate_from_kv(continuation(req, first.token_ids), handoff, ctx):
        outs.append(out)
        if len(outs) == 1:
            ctx.stop_generating()
    assert outs[-1].finish_reason == "cancelled"
    usage = outs[-1].completion_usage
    assert usage is not None and usage.completion_tokens == len(ids(outs)) < 399
    # Stopped before it starts: nothing is loaded.
    ctx = Context()
    ctx.stop_generating()
    first, handoff = await prefill.prefill(req, Context())
    outs = await _from_kv(decode, continuation(req, first.token_ids), handoff, ctx)
    assert [o.finish_reason for o in outs] == ["cancelled"] and not ids(outs)
    # The context is free and serves the next request from scratch.
    assert ids(await asyncio.wait_for(collect(decode, request(token_ids[1], 8)), 10)) == reference(
        token_ids[1], 8
    )
    await asyncio.wait_for(decode.drain(), 5)
