"""`out=llamacpp` log-probabilities and guided decoding (grammars), against llama.cpp's own numbers
and through `dyngraph run in=http` with the official `openai` client; and the 400 an engine
without these features answers."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import OutputOptions, SamplingOptions
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.engines.llamacpp.engine import LlamaCppArgs, LlamaCppEngine
from dynamo_graph.llm.model_source import resolve_model
from tests.support.engine_requests import collect, greedy_request, ids
from tests.support.processes import ServerProcess, running_server

if os.environ.get("CI"):
    import llama_cpp
else:
    llama_cpp = pytest.importorskip("llama_cpp")

EOS = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confident": {"type": "boolean"},
        "word": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "confident", "word"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llama_reference(tiny_model: Path) -> Iterator[llama_cpp.Llama]:
    """llama.cpp keeping every position's logits, to read its own log-probabilities from."""
    llm = llama_cpp.Llama(model_path=str(tiny_model / GGUF_NAME), n_ctx=512, logits_all=True, verbose=False)
    yield llm
    llm.close()


def reference_logprobs(llm: llama_cpp.Llama, prompt: list[int], output: list[int]) -> np.ndarray:
    """Rows of log-probabilities (llama.cpp's `Llama.logits_to_logprobs`) at each output position."""
    llm.reset()
    llm.eval(prompt + output[:-1])
    scores = llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    return llama_cpp.Llama.logits_to_logprobs(scores)


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[LlamaCppEngine]:
    eng = LlamaCppEngine(tiny_model / GGUF_NAME, LlamaCppArgs(), default_n_ctx=512, tokenizer_vocab_size=2048)
    await eng.start()
    yield eng
    await eng.cleanup()


def token_prompt(tiny_model: Path, text: str) -> list[int]:
    return resolve_model(str(tiny_model)).load_tokenizer().encode(text).ids


async def test_logprobs_equal_llama_cpps_own(
    engine: LlamaCppEngine, llama_reference: llama_cpp.Llama, tiny_model: Path
) -> None:
    prompt = token_prompt(tiny_model, "Once upon a time, in a land far away, there lived")
    req = greedy_request(prompt, 12, eos_token_ids=[EOS])
    req.output_options = OutputOptions(logprobs=3)
    outs = await collect(engine, req)
    out_ids = ids(outs)
    logprobs = [lp for o in outs for lp in o.log_probs or []]
    tops = [t for o in outs for t in o.top_logprobs or []]
    assert len(out_ids) == len(logprobs) == len(tops) == 12
    rows = reference_logprobs(llama_reference, prompt, out_ids)
    for i, token in enumerate(out_ids):
        assert logprobs[i] == pytest.approx(float(rows[i][token]), abs=1e-3)
        assert tops[i][0].token_id == token  # greedy: the sampled token is the likeliest
        expected = sorted(range(len(rows[i])), key=lambda t: -rows[i][t])[:3]
        assert {t.token_id for t in tops[i]} == set(expected)
        assert [t.logprob for t in tops[i]] == pytest.approx([float(rows[i][t]) for t in expected], abs=1e-3)
    plain = await collect(engine, greedy_request(prompt, 12, eos_token_ids=[EOS]))
    assert ids(plain) == out_ids and all(o.log_probs is None for o in plain)  # only when asked


async def test_logprobs_and_grammars_of_requests_decoded_together(tiny_model: Path) -> None:
    """Four requests in one batch: each one's log-probabilities come from its own row of logits
    and its grammar constrains only it, as when each runs alone."""
    engine = LlamaCppEngine(
        tiny_model / GGUF_NAME, LlamaCppArgs(n_parallel=4), default_n_ctx=512, tokenizer_vocab_size=2048
    )
    await engine.start()
    try:
        texts = ["Once upon a time", "The quick brown fox", "it's 12345 $3.14", "Is the sky blue?"]
        reqs = [greedy_request(token_prompt(tiny_model, text), 10, eos_token_ids=[EOS]) for text in texts]
        reqs[3].sampling_options = SamplingOptions(temperature=0.0, guided_choice=["yes", "no"])
        for req in reqs:
            req.output_options = OutputOptions(logprobs=2)
        alone = [await collect(engine, req) for req in reqs]
        together = await asyncio.gather(*(collect(engine, req) for req in reqs))

        def view(outs: list) -> tuple[list[int], list[float], list[list[int]]]:
            tops = [[t.token_id for t in top] for o in outs for top in o.top_logprobs or []]
            return ids(outs), [lp for o in outs for lp in o.log_probs or []], tops

        for one, batched in zip(alone, together, strict=True):
            (a_ids, a_lps, a_tops), (b_ids, b_lps, b_tops) = view(one), view(batched)
            assert (a_ids, a_tops) == (b_ids, b_tops)
            assert b_lps == pytest.approx(a_lps, abs=1e-4)
        assert len({tuple(view(outs)[1]) for outs in alone}) == 4  # four different rows were read
        tok = resolve_model(str(tiny_model)).load_tokenizer()
        assert tok.decode(ids(together[3])) in ("yes", "no") and together[3][-1].finish_reason == "stop"
    finally:
        await engine.cleanup()


async def test_grammars_constrain_and_bad_ones_are_refused(engine: LlamaCppEngine, tiny_model: Path) -> None:
    tok = resolve_model(str(tiny_model)).load_tokenizer()
    prompt = token_prompt(tiny_model, "Is the sky blue?")
    choices = ["yes", "no", "a long maybe"]
    for sampling, check in (
        (SamplingOptions(guided_choice=choices), lambda text: text in choices),
        (SamplingOptions(guided_grammar='root ::= "x" [0-9] [0-9]'), lambda text: len(text) == 3),
        (SamplingOptions(guided_json=SCHEMA), lambda text: set(json.loads(text)) == set(SCHEMA["required"])),
    ):
        outs = await collect(engine, greedy_request(prompt, 64, eos_token_ids=[EOS], sampling=sampling))
        assert outs[-1].finish_reason == "stop"  # the grammar completed; only eos was left
        text = tok.decode([t for t in ids(outs) if t != EOS], skip_special_tokens=False)
        assert check(text), text
    for sampling, param in (
        (SamplingOptions(guided_grammar="root ::= oops ("), "guided_grammar"),
        (SamplingOptions(guided_regex="a+"), "guided_regex"),
        (SamplingOptions(guided_json="{not json"), "guided_json"),
    ):
        with pytest.raises(InvalidArgument) as exc:
            await collect(engine, greedy_request(prompt, 4, eos_token_ids=[EOS], sampling=sampling))
        assert exc.value.param == param


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        ["out=llamacpp", "--model-path", str(tiny_model)], log_dir=tmp_path_factory.mktemp("logs")
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def valid(answer: dict) -> bool:
    return (
        set(answer) == {"answer", "confident", "word"}
        and answer["answer"] in ("yes", "no", "maybe")
        and isinstance(answer["confident"], bool)
        and isinstance(answer["word"], str)
        and len(answer["word"]) <= 6
    )


def test_json_schema_output_validates_for_20_prompts(client: openai.OpenAI, tiny_model: Path) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for i in range(20):
        resp = client.chat.completions.create(
            model=tiny_model.name,
            messages=[{"role": "user", "content": f"Question {i}: is {i} a lucky number?"}],
            response_format=response_format,  # type: ignore[arg-type]
            max_tokens=80,
            temperature=0.8,
            seed=i,
        )
        assert resp.choices[0].finish_reason == "stop"
        assert valid(json.loads(resp.choices[0].message.content or "")), resp.choices[0].message.content
    resp = client.chat.completions.create(
        model=tiny_model.name,
        messages=[{"role": "user", "content": "Any JSON object, please."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    if resp.choices[0].finish_reason == "stop":  # a random-weight model may ramble past max_tokens
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    else:
        assert (resp.choices[0].message.content or "").lstrip().startswith("{")


def test_guided_extensions_and_unsupported_ones(client: openai.OpenAI, tiny_model: Path) -> None:
    messages = [{"role": "user", "content": "Pick one."}]
    resp = client.chat.completions.create(
        model=tiny_model.name,
        messages=messages,
        extra_body={"guided_choice": ["red", "green"]},  # type: ignore[arg-type]
    )
    assert resp.choices[0].message.content in ("red", "green")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=tiny_model.name,
            messages=messages,
            extra_body={"guided_regex": "[a-z]+"},  # type: ignore[arg-type]
        )
    assert exc.value.body["param"] == "guided_regex"  # type: ignore[index]
    assert "'llamacpp'" in exc.value.body["message"]  # type: ignore[index]


def test_logprobs_through_http_equal_llama_cpps(
    client: openai.OpenAI, tiny_model: Path, llama_reference: llama_cpp.Llama
) -> None:
    tok = resolve_model(str(tiny_model)).load_tokenizer()
    prompt = token_prompt(tiny_model, "The quick brown fox jumps over the lazy dog.")
    for stream in (False, True):
        resp = client.completions.create(
            model=tiny_model.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, stream=stream
        )
        choices = [c.choices[0] for c in resp] if stream else resp.choices  # type: ignore[union-attr]
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens or []]
        values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs or []]
        text = "".join(c.text for c in choices)
        assert "".join(tokens) == text and len(values) == 8
        out_ids = tok.encode(text, add_special_tokens=False).ids
        rows = reference_logprobs(llama_reference, prompt, out_ids)
        if len(out_ids) == 8:  # the text re-encodes to the same ids (true for this prompt)
            assert values == pytest.approx([float(rows[i][t]) for i, t in enumerate(out_ids)], abs=1e-3)
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    chat = client.chat.completions.create(
        model=tiny_model.name, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert all(isinstance(c, ChatCompletionTokenLogprob) and len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob for c in content)
    streamed = client.chat.completions.create(
        model=tiny_model.name, messages=messages, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in entries] == [c.token for c in content]
    # The second request reuses the first one's cached prefix: the same values up to rounding.
    assert [e.logprob for e in entries] == pytest.approx([c.logprob for c in content], abs=1e-3)


def test_engines_without_the_feature_answer_400(tiny_model: Path, tmp_path: Path) -> None:
    with running_server(["out=echo_core", "--model-path", str(tiny_model)], log_dir=tmp_path) as proc:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        cases = [
            ({"logprobs": True}, "logprobs"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"extra_body": {"guided_json": SCHEMA}}, "guided_json"),
        ]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(model=tiny_model.name, messages=messages, **kwargs)  # type: ignore[arg-type]
            assert exc.value.body["param"] == param  # type: ignore[index]
            assert "engine 'echo_core'" in exc.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=tiny_model.name, prompt="hi", logprobs=1)
        assert exc.value.body["param"] == "logprobs"  # type: ignore[index]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"utc": {"type": "boolean"}},
                "required": ["utc"],
                "additionalProperties": False,
            },
        },
    },
]
VALID_ARGS = {
    "get_weather": lambda a: a["city"] in ("Paris", "Rome"),
    "get_time": lambda a: a["utc"] in (True, False),
}


def streamed_calls(stream: openai.Stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        assert not choice.delta.content
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_forced_tool_choice_is_guided_decoding(client: openai.OpenAI, tiny_model: Path) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for i, (choice, parallel) in enumerate([("required", False), ("required", None), (named, None)]):
        kwargs = {"parallel_tool_calls": parallel} if parallel is not None else {}
        request = dict(
            model=tiny_model.name,
            messages=[{"role": "user", "content": f"Call something ({i})."}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            **kwargs,
        )
        resp = client.chat.completions.create(**request)  # type: ignore[call-overload]
        whole = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in resp.choices[0].message.tool_calls or []
        ]
        streamed, finish = streamed_calls(client.chat.completions.create(**request, stream=True))
        assert resp.choices[0].finish_reason == finish == "tool_calls"
        assert resp.choices[0].message.content is None
        for calls in (whole, streamed):
            assert calls and all(VALID_ARGS[c["name"]](json.loads(c["arguments"])) for c in calls)
            if parallel is False or choice is named:
                assert len(calls) == 1
            if choice is named:
                assert calls[0]["name"] == "get_time"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=tiny_model.name,
            messages=[{"role": "user", "content": "hi"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "launch_rockets"}},
        )
    assert exc.value.body["param"] == "tool_choice"  # type: ignore[index]
    assert "launch_rockets" in exc.value.body["message"]  # type: ignore[index]
