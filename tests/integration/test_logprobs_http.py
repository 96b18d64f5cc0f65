"""logprobs through `dyngraph run in=http out=mocker` with the official `openai` client: OpenAI's
shapes (the client's own types), streamed and not, and the mocker's true values."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob
from openai.types.completion_choice import Logprobs

from dynamo_graph.backend.protocol import TopLogprob
from dynamo_graph.engines.mocker.scheduler import TokenSampler
from tests.support.processes import running_server


def test_the_mocker_reports_its_uniform_distribution() -> None:
    sampler = TokenSampler(seed=7, vocab_size=10, reserved=frozenset({3, 4}), top_logprobs=3)
    logprob, top = sampler.logprobs(2)
    assert logprob == pytest.approx(-math.log(8))  # 8 drawable ids
    assert top == [TopLogprob(token_id=t, logprob=logprob) for t in (2, 5, 6)]  # reserved ids skipped
    assert (
        TokenSampler(seed=7, vocab_size=10, reserved=frozenset(), top_logprobs=20).logprobs(9)[1][1].token_id
        == 0
    )


@pytest.fixture(scope="module")
def client(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    args = ["out=mocker", "--model-path", str(tiny_model), "--extra-engine-args"]
    config = tmp_path_factory.mktemp("cfg") / "mocker.json"
    config.write_text('{"speedup_ratio": 1000}')
    with running_server([*args, str(config)], log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=30)


MESSAGES = [{"role": "user", "content": "Tell me something."}]


def test_chat_logprobs(client: openai.OpenAI, tiny_model: Path) -> None:
    resp = client.chat.completions.create(
        model=tiny_model.name,
        messages=MESSAGES,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == resp.usage.completion_tokens == 8  # type: ignore[union-attr]
    assert all(isinstance(e, ChatCompletionTokenLogprob) for e in content)
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    uniform = content[0].logprob
    assert uniform < -math.log(100)  # the tiny vocabulary has 2048 ids, a few of them reserved
    for e in content:
        assert e.logprob == uniform and bytes(e.bytes or []) == e.token.encode()
        assert [t.logprob for t in e.top_logprobs] == [uniform] * 3 and e.top_logprobs[0].token == e.token
    only = client.chat.completions.create(
        model=tiny_model.name, messages=MESSAGES, max_tokens=8, logprobs=True
    )  # type: ignore[arg-type]
    assert [e.top_logprobs for e in only.choices[0].logprobs.content] == [[]] * 8  # type: ignore[union-attr]
    assert (
        client.chat.completions.create(model=tiny_model.name, messages=MESSAGES, max_tokens=2)
        .choices[0]
        .logprobs
        is None
    )  # type: ignore[arg-type]

    stream = client.chat.completions.create(
        model=tiny_model.name,
        messages=MESSAGES,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        stream=True,  # type: ignore[arg-type]
    )
    streamed = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in streamed] == [
        (e.token, e.logprob, 3) for e in content
    ]  # the mocker is deterministic: same prompt, same tokens


def test_completion_logprobs(client: openai.OpenAI, tiny_model: Path) -> None:
    resp = client.completions.create(
        model=tiny_model.name, prompt="Once upon a time", max_tokens=6, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert isinstance(lp, Logprobs) and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(
        len(top) <= 2 and top[lp.tokens[i]] == lp.token_logprobs[i] for i, top in enumerate(lp.top_logprobs)
    )
    stream = client.completions.create(
        model=tiny_model.name, prompt="Once upon a time", max_tokens=6, logprobs=2, stream=True
    )
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens or []] == lp.tokens
    assert [o for c in chunks for o in c.text_offset or []] == lp.text_offset
