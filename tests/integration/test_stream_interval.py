"""`--stream-interval N` through the official `openai` client: the same answer in fewer events."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.echo_chat import IGNORE_EOS, QUESTION, TEMPLATED
from tests.support.processes import ServerProcess

EVERY = 4


@pytest.fixture(scope="module")
def client(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    argv = ["out=echo_core", "--model-path", str(tiny_model), "--stream-interval", str(EVERY)]
    proc = ServerProcess(argv, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        proc.wait_ready()
        yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    finally:
        assert proc.stop() == 0, proc.log()


def test_chat_stream_is_the_same_answer_in_fewer_events(client: openai.OpenAI, tiny_model: Path) -> None:
    chunks = list(
        client.chat.completions.create(
            model=tiny_model.name,
            messages=[{"role": "user", "content": QUESTION}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    )
    tokens = chunks[-1].usage.completion_tokens
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content for c in content) == TEMPLATED
    # The first token at once, then one event per EVERY tokens; the rest with the finish reason.
    assert len(content) == 1 + math.ceil((tokens - 1) / EVERY)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_stream_is_the_same_text(client: openai.OpenAI, tiny_model: Path) -> None:
    stream = client.completions.create(
        model=tiny_model.name,
        prompt="Hello world",
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == "<|begin_of_text|>Hello world"
    assert len(texts) == 1 + math.ceil((chunks[-1].usage.completion_tokens - 1) / EVERY)
