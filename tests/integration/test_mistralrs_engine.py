"""`out=mistralrs` with the real mistral.rs on the tiny model: the engine directly, then the full stack.

Skipped when mistralrs is not installed, except under CI (env CI set), where it must be.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo_graph.backend.errors import EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo_graph.backend.settings import EngineSettings
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.llm.model_source import LocalModel, resolve_model
from dynamo_graph.runtime.context import Context
from tests.support.processes import ServerProcess, run_cli

if os.environ.get("CI"):
    import mistralrs  # noqa: F401 - CI installs the extra: a missing package must fail, not skip
else:
    pytest.importorskip("mistralrs")

from dynamo_graph.engines.mistralrs.args import MistralrsArgs, MistralrsError
from dynamo_graph.engines.mistralrs.engine import MistralrsEngine
from dynamo_graph.engines.mistralrs.vocab import TokenBytes

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> LocalModel:
    return resolve_model(str(tiny_model))


@pytest.fixture(scope="module")
def prompt_ids(model: LocalModel) -> list[int]:
    return model.load_tokenizer().encode(PROMPT).ids


@pytest.fixture
async def engine(model: LocalModel) -> AsyncIterator[MistralrsEngine]:
    eng = MistralrsEngine(model, MistralrsArgs(max_seqs=4))
    await eng.start()
    yield eng
    await eng.cleanup()


def request(ids: list[int], max_tokens: int = 16, **kw: Any) -> PreprocessedRequest:
    sampling = kw.pop("sampling", SamplingOptions())
    eos = kw.pop("eos_token_ids", [4, 1])
    return PreprocessedRequest(
        model="tiny",
        token_ids=ids,
        stop_conditions=StopConditions(max_tokens=max_tokens, **kw),
        sampling_options=sampling,
        eos_token_ids=eos,
    )


async def collect(engine: MistralrsEngine, req: PreprocessedRequest, ctx: Context | None = None):
    outs: list[LLMEngineOutput] = [o async for o in engine.generate(req, ctx or Context())]
    return [t for o in outs for t in o.token_ids], outs[-1]


async def test_greedy_is_deterministic_and_reports_usage(
    engine: MistralrsEngine, prompt_ids: list[int]
) -> None:
    ids, last = await collect(engine, request(prompt_ids, 32))
    again, _ = await collect(engine, request(prompt_ids, 32))
    assert len(ids) == 32 and ids == again
    assert all(6 <= t < 2048 for t in ids)  # the tiny model never picks its special tokens
    assert last.finish_reason == "length"
    assert last.completion_usage is not None
    assert last.completion_usage.prompt_tokens == len(prompt_ids)
    assert last.completion_usage.completion_tokens == 32


async def test_greedy_ids_match_llamacpp(
    engine: MistralrsEngine, tiny_model: Path, prompt_ids: list[int]
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tiny_model / GGUF_NAME), n_ctx=512, verbose=False)
    expected: list[int] = []
    for tok in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        expected.append(tok)
        if len(expected) == 16:
            break
    ids, _ = await collect(engine, request(prompt_ids, 16))
    assert ids == expected


async def test_gguf_gives_the_same_ids(
    engine: MistralrsEngine, tiny_model: Path, prompt_ids: list[int]
) -> None:
    gguf = MistralrsEngine(resolve_model(str(tiny_model / GGUF_NAME)))
    try:
        config = await gguf.start()
        assert config.model_input == "tokens" and config.context_length == 512
        assert (await collect(gguf, request(prompt_ids, 16)))[0] == (
            await collect(engine, request(prompt_ids, 16))
        )[0]
    finally:
        await gguf.cleanup()


async def test_sampled_ids_decode_to_the_streamed_bytes(model: LocalModel, prompt_ids: list[int]) -> None:
    """The logprob bytes -> id map agrees with the tokenizer on sampled (non-greedy) tokens."""
    import mistralrs

    tok = model.load_tokenizer()
    vocab = TokenBytes(tok)
    runner = mistralrs.Runner(
        which=mistralrs.Which.Plain(
            model_id=str(model.root), arch=mistralrs.Architecture.Llama, dtype=mistralrs.ModelDType.F32
        ),
        token_source="none",
    )
    req = mistralrs.ChatCompletionRequest(
        messages=runner.detokenize_text(prompt_ids, False),
        model="default",
        max_tokens=64,
        temperature=1.5,
        stream=True,
        logprobs=True,
        top_logprobs=1,
        ignore_eos=True,
    )
    raw = b""
    ids: list[int] = []
    for chunk in runner.send_chat_completion_request(req):
        lp = chunk.choices[0].logprobs
        token_id = vocab.lookup(bytes(lp.bytes), [])
        assert token_id is not None, lp.bytes
        ids.append(token_id)
        raw += bytes(lp.bytes)
    assert len(ids) == 64
    assert tok.decode(ids, skip_special_tokens=False) == raw.decode("utf-8", "replace")


async def test_max_tokens_and_stop_ids(engine: MistralrsEngine, prompt_ids: list[int]) -> None:
    full, _ = await collect(engine, request(prompt_ids, 16))
    ids, last = await collect(engine, request(prompt_ids, 5))
    assert ids == full[:5] and last.finish_reason == "length"
    stop = full[3]
    first = full.index(stop)
    ids, last = await collect(engine, request(prompt_ids, 16, stop_token_ids=[stop]))
    assert ids == full[: first + 1] and last.finish_reason == "stop"  # the stop id is sent (and counted)
    assert last.completion_usage is not None and last.completion_usage.completion_tokens == first + 1
    # min_tokens: a stop id at or before min_tokens is an ordinary token (as the postprocessor does).
    later = next((i for i in range(first + 1, 16) if full[i] == stop), None)
    if later is not None:
        ids, last = await collect(
            engine, request(prompt_ids, 16, stop_token_ids=[stop], min_tokens=first + 1)
        )
        assert ids == full[: later + 1] and last.finish_reason == "stop"
    # eos ids stop generation unless ignore_eos.
    eos_req = request(prompt_ids, 16, eos_token_ids=[stop])
    assert (await collect(engine, eos_req))[0] == full[: first + 1]
    ids, last = await collect(engine, request(prompt_ids, 16, eos_token_ids=[stop], ignore_eos=True))
    assert ids == full and last.finish_reason == "length"


async def test_cancellation_ends_with_cancelled(engine: MistralrsEngine, prompt_ids: list[int]) -> None:
    ctx = Context()
    outs: list[LLMEngineOutput] = []
    async for out in engine.generate(request(prompt_ids, 400), ctx):
        outs.append(out)
        if len(outs) == 3:
            ctx.stop_generating()
    assert outs[-1].finish_reason == "cancelled"
    assert len(outs) < 20
    # The engine is free again: a full request right after runs normally.
    start = time.monotonic()
    ids, last = await collect(engine, request(prompt_ids, 16))
    assert len(ids) == 16 and last.finish_reason == "length"
    assert time.monotonic() - start < 5
    # A consumer that goes away (aclose) cancels too.
    gen = engine.generate(request(prompt_ids, 400), Context())
    await gen.__anext__()
    await gen.aclose()
    assert len((await collect(engine, request(prompt_ids, 8)))[0]) == 8


async def test_concurrent_requests_match_solo_runs(engine: MistralrsEngine, model: LocalModel) -> None:
    tok = model.load_tokenizer()
    prompts = [tok.encode(p).ids for p in (PROMPT, "Hello there", "def f(x):\n    return", "1 2 3 4 5")]
    lengths = [24, 8, 16, 32, 12, 20]  # 6 requests on max_seqs=4: two wait for a slot
    jobs = [(prompts[i % len(prompts)], n) for i, n in enumerate(lengths)]
    solo = [(await collect(engine, request(p, n)))[0] for p, n in jobs]
    together = await asyncio.gather(*(collect(engine, request(p, n)) for p, n in jobs))
    assert [ids for ids, _ in together] == solo
    assert [len(ids) for ids in solo] == lengths


async def test_bad_requests_and_cleanup(model: LocalModel, prompt_ids: list[int]) -> None:
    eng = MistralrsEngine(model)
    await eng.cleanup()  # before start: fine
    await eng.cleanup()
    eng = MistralrsEngine(model, context_length=64)
    config = await eng.start()
    assert config.context_length == 64 and config.max_num_seqs == 16
    with pytest.raises(InvalidArgument, match="context length 64"):
        await collect(eng, request(list(range(6, 70)), 4))
    ids, last = await collect(eng, request(prompt_ids, 1000))  # capped by the context length
    assert len(ids) == 64 - len(prompt_ids) and last.finish_reason == "length"
    with pytest.raises(InvalidArgument, match="n and best_of"):
        await collect(eng, request(prompt_ids, 4, sampling=SamplingOptions(n=2)))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        await collect(eng, request([0, 99999], 4))
    await eng.cleanup()
    await eng.cleanup()
    with pytest.raises(EngineShutdown):
        await collect(eng, request(prompt_ids, 4))


def test_extra_engine_args_are_checked(model: LocalModel, tmp_path: Path) -> None:
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"max_seqs": 2, "bogus": 1}))
    with pytest.raises(MistralrsError, match=r"unknown mistralrs setting.*bogus.*known: dtype, max_seqs"):
        MistralrsEngine.from_config(EngineSettings(extra_engine_args=args_file), model)
    with pytest.raises(MistralrsError, match="dtype must be one of"):
        MistralrsArgs.from_mapping({"dtype": "f64"})
    with pytest.raises(MistralrsError, match="arch 'nope'"):
        MistralrsEngine(model, MistralrsArgs(arch="nope"))._architecture()
    # The CLI prints it as a plain error.
    result = run_cli(
        ["run", "in=none", "out=mistralrs", str(model.root), "--extra-engine-args", str(args_file)]
    )
    assert result.returncode == 2, result.stderr
    assert "unknown mistralrs setting(s) bogus" in result.stderr and "Traceback" not in result.stderr


# ---- the full stack: dyngraph run in=http out=mistralrs + the official openai client ----------


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        ["out=mistralrs", "--model-path", str(tiny_model)], log_dir=tmp_path_factory.mktemp("logs")
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def test_http_chat(server: ServerProcess, tiny_model: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "What is the capital of Tuvalu?"}]
    first = client.chat.completions.create(
        model=tiny_model.name, messages=messages, max_tokens=16, temperature=0
    )
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 16
    assert first.usage.prompt_tokens > 10
    text = first.choices[0].message.content
    assert text

    stream = client.chat.completions.create(
        model=tiny_model.name,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same answer, streamed
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 16
    assert usage.prompt_tokens == first.usage.prompt_tokens

    start = time.monotonic()
    long = client.chat.completions.create(
        model=tiny_model.name, messages=messages, max_tokens=256, temperature=0
    )
    elapsed = time.monotonic() - start
    assert long.usage is not None and long.usage.completion_tokens == 256
    print(f"\nmistralrs full stack: 256 tokens in {elapsed:.3f}s = {256 / elapsed:.0f} tok/s")


async def test_non_canonical_prompt_is_served_with_a_warning(
    engine: MistralrsEngine, model: LocalModel, caplog: pytest.LogCaptureFixture
) -> None:
    tok = model.load_tokenizer()
    chars = [tok.token_to_id(c) for c in "The"]  # "The" is one token canonically
    assert None not in chars and tok.encode("The").ids != [0, *chars]
    with caplog.at_level("WARNING", logger="dynamo_graph.engines.mistralrs"):
        ids, last = await collect(engine, request([0, *chars], 4))  # type: ignore[list-item]
    assert len(ids) == 4 and last.finish_reason == "length"
    assert "do not survive detokenize/tokenize" in caplog.text


def test_missing_package_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from dynamo_graph.engines.mistralrs.args import import_mistralrs

    monkeypatch.setitem(sys.modules, "mistralrs", None)
    with pytest.raises(MistralrsError, match=r"pip install -e '\.\[mistralrs\]' in dyngraph's checkout"):
        import_mistralrs()


def test_http_logprobs_and_guided_decoding(server: ServerProcess, tiny_model: Path) -> None:
    """What the card advertises is served (logprobs, guided_choice/regex/json); guided_grammar
    (mistral.rs parses Lark, not GBNF) is a 400 naming the field and the engine."""
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    kw: dict[str, Any] = {
        "model": tiny_model.name,
        "messages": [{"role": "user", "content": "What is the capital of Tuvalu?"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    content = client.chat.completions.create(**kw).choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    for entry in content:  # greedy: the sampled token is the most likely one
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == entry.top_logprobs[0].logprob < 0
    streamed = [
        e for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]

    plain = {k: v for k, v in kw.items() if "logprobs" not in k}
    for _ in range(3):
        choice = client.chat.completions.create(**plain, extra_body={"guided_choice": ["yes", "no"]})
        assert choice.choices[0].message.content in ("yes", "no")
    digits = client.chat.completions.create(**plain, extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].message.content or "")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = client.chat.completions.create(
        **plain, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    )
    assert (constrained.choices[0].message.content or "").startswith("{")  # the tiny model rambles on in JSON
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**plain, extra_body={"guided_grammar": 'root ::= "yes"'})
    assert err.value.body["param"] == "guided_grammar" and "mistralrs" in err.value.body["message"]  # type: ignore[index]
