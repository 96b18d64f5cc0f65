"""The official `openai` client against `dyngraph run in=http out=echo_core <tiny model>`."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.echo_chat import IGNORE_EOS, QUESTION, TEMPLATED
from tests.support.http_streams import cancelled_streams, paced_server
from tests.support.metrics import metric
from tests.support.processes import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        ["out=echo_core", "--model-path", str(tiny_model)], log_dir=tmp_path_factory.mktemp("logs")
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model_name(tiny_model: Path) -> str:
    return tiny_model.name


@pytest.fixture(scope="module")
def prompt_tokens(tiny_model: Path) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    return len(tok.encode(TEMPLATED, add_special_tokens=False).ids)


def chat(client: openai.OpenAI, model: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], **kw)


def test_models_lists_the_model(client: openai.OpenAI, model_name: str) -> None:
    (model,) = client.models.list()
    assert model.id == model_name
    assert model.endpoints == [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/completions",
        "/inference/v1/generate",
    ]


def test_chat_returns_templated_prompt(client: openai.OpenAI, model_name: str, prompt_tokens: int) -> None:
    resp = chat(client, model_name, extra_body=IGNORE_EOS)
    assert resp.choices[0].message.content == TEMPLATED
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == prompt_tokens
    assert resp.usage.total_tokens == 2 * prompt_tokens


def test_chat_streaming_matches_and_reports_usage(
    client: openai.OpenAI, model_name: str, prompt_tokens: int
) -> None:
    stream = chat(
        client, model_name, stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEMPLATED
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == prompt_tokens
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_eos_in_template_stops_without_ignore_eos(client: openai.OpenAI, model_name: str) -> None:
    resp = chat(client, model_name)
    assert resp.choices[0].message.content == TEMPLATED.split("<|eot_id|>")[0]
    assert resp.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(client: openai.OpenAI, model_name: str) -> None:
    resp = chat(client, model_name, max_tokens=3, extra_body=IGNORE_EOS)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3
    assert TEMPLATED.startswith(resp.choices[0].message.content)


def test_stop_string_is_not_emitted(client: openai.OpenAI, model_name: str) -> None:
    for stream in (False, True):
        resp = chat(client, model_name, stop=["capital"], stream=stream, extra_body=IGNORE_EOS)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in resp if c.choices)
        else:
            text = resp.choices[0].message.content
        assert text == TEMPLATED.split("capital")[0]


def test_completions_streaming_and_not(client: openai.OpenAI, model_name: str) -> None:
    resp = client.completions.create(model=model_name, prompt="Hello world", max_tokens=50)
    assert resp.choices[0].text == "<|begin_of_text|>Hello world"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == resp.usage.completion_tokens
    stream = client.completions.create(model=model_name, prompt="Hello world", max_tokens=50, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "<|begin_of_text|>Hello world"


def test_completions_default_max_tokens_is_16(client: openai.OpenAI, model_name: str) -> None:
    resp = client.completions.create(model=model_name, prompt="word " * 40)
    assert resp.usage.completion_tokens == 16
    assert resp.choices[0].finish_reason == "length"


def test_completions_token_id_prompt(client: openai.OpenAI, model_name: str) -> None:
    resp = client.completions.create(model=model_name, prompt=[45, 544, 344], max_tokens=10)
    assert resp.usage.prompt_tokens == 3
    assert resp.usage.completion_tokens == 3


def test_unicode_round_trips(client: openai.OpenAI, model_name: str) -> None:
    text = "Tuvalu 🇹🇻 首都 👩‍👩‍👧 café"
    resp = client.completions.create(model=model_name, prompt=text, max_tokens=200, stream=True)
    assert "".join(c.choices[0].text for c in resp if c.choices) == "<|begin_of_text|>" + text


def test_health_live_metrics(server: ServerProcess, model_name: str) -> None:
    health = httpx.get(f"{server.base_url}/health").json()
    assert health["status"] == "healthy" and health["models"] == [model_name]
    assert httpx.get(f"{server.base_url}/live").json()["status"] == "live"
    metrics = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "dynamo_frontend_requests_total",
        "dynamo_frontend_inflight_requests",
        "dynamo_frontend_time_to_first_token_seconds",
        "dynamo_frontend_inter_token_latency_seconds",
        "dynamo_frontend_request_duration_seconds",
        "dynamo_frontend_input_sequence_tokens",
        "dynamo_frontend_output_sequence_tokens",
    ):
        assert name in metrics


def stream_body(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "nvext": {"ignore_eos": True},
    }


def test_client_disconnect_cancels_generation(tiny_model: Path, tmp_path: Path) -> None:
    """A slow stream (100 ms per token) abandoned after two chunks ends well before it would
    have finished, and the frontend counts it as cancelled."""
    proc = paced_server(tiny_model, tmp_path, 100)
    try:
        body = stream_body(tiny_model.name)
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", f"{proc.base_url}/v1/chat/completions", json=body) as resp,
        ):
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: ") for line in got)
        # The whole stream would take ~2.4 s; cancellation must end it long before.
        assert cancelled_streams(proc, "chat_completions", tiny_model.name) == 1
        assert metric(proc, "dynamo_frontend_inflight_requests") == 0
    finally:
        proc.stop()


def test_keep_alive_streams_do_not_stall(server: ServerProcess, model_name: str) -> None:
    """TCP_NODELAY: streamed responses on one kept-alive connection take milliseconds, not the
    ~40 ms Nagle + delayed-ACK stall, as Dynamo 1.6.1 showed."""
    body = stream_body(model_name)
    times = []
    with httpx.Client(timeout=10) as http:
        for _ in range(7):
            start = time.perf_counter()
            with http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as resp:
                for _line in resp.iter_lines():
                    pass
            times.append(time.perf_counter() - start)
    times.sort()
    assert times[len(times) // 2] < 0.035, times


def test_sigterm_lets_inflight_stream_finish(tiny_model: Path, tmp_path: Path) -> None:
    """SIGTERM mid-stream: the response still completes, then the process exits 0."""
    proc = paced_server(tiny_model, tmp_path, 20)
    try:
        body = stream_body(tiny_model.name)
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", f"{proc.base_url}/v1/chat/completions", json=body) as resp,
        ):
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            proc.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert '"finish_reason":"stop"' in "".join(rest)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert proc.proc.wait(timeout=10) == 0
    finally:
        proc.stop()
