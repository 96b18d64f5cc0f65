"""A request field its API does not have is a 400 naming it on every generation route, through
the official clients where they exist; `--http-unknown-fields ignore` serves such requests.

Against the mocker (it serves chat, completions, Responses, Messages and token generation);
embeddings are covered in test_embeddings_http.py, where an embedding worker runs anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.processes import ServerProcess, echo_core_args, running_server

anthropic = pytest.importorskip("anthropic")

MSG = [{"role": "user", "content": "hi"}]
MODEL = "tiny"


@pytest.fixture(scope="module")
def strict(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["out=mocker", "--model-path", str(tiny_model), "--model-name", MODEL]
    with running_server(args, log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


def refused(err: openai.BadRequestError | anthropic.BadRequestError) -> dict:
    assert err.status_code == 400
    body = err.response.json()
    return body["error"]


def test_chat_names_the_misspelled_field(strict: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai(strict).chat.completions.create(model=MODEL, messages=MSG, extra_body={"maxtokens": 4})
    error = refused(caught.value)
    assert error["param"] == "maxtokens"
    assert error["code"] == "unknown_field"
    assert "`maxtokens` (did you mean `max_tokens`?)" in error["message"]


def test_streamed_chat_is_refused_before_any_event(strict: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai(strict).chat.completions.create(
            model=MODEL, messages=MSG, stream=True, extra_body={"max_tokns": 4, "tempreature": 0.5}
        )
    error = refused(caught.value)
    assert error["param"] == "max_tokns"
    assert "arguments supplied: `max_tokns`" in error["message"]
    assert "`tempreature` (did you mean `temperature`?)" in error["message"]


def test_completions_names_the_field(strict: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai(strict).completions.create(model=MODEL, prompt="hi", extra_body={"echos": True})
    assert refused(caught.value)["param"] == "echos"


def test_responses_refuses_chat_spelling_of_max_tokens(strict: ServerProcess) -> None:
    """The Responses API calls it max_output_tokens: `max_tokens` there used to be ignored."""
    with pytest.raises(openai.BadRequestError) as caught:
        oai(strict).responses.create(model=MODEL, input="hi", extra_body={"max_tokens": 4})
    error = refused(caught.value)
    assert error["param"] == "max_tokens"
    assert "did you mean `max_output_tokens`" in error["message"]


def test_messages_and_count_tokens_answer_anthropic_errors(strict: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=strict.base_url, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=4, messages=MSG, extra_body={"max_tokns": 4})
    body = caught.value.response.json()
    assert body["type"] == "error"
    assert "`max_tokns` (did you mean `max_tokens`?)" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=MODEL, messages=MSG, extra_body={"sytem": "x"})
    assert "`sytem` (did you mean `system`?)" in caught.value.response.json()["error"]["message"]


def test_generate_tokens_names_the_field(strict: ServerProcess) -> None:
    body = {"model": MODEL, "token_ids": [1, 2, 3], "max_tokens": 4}  # belongs in sampling_params
    answer = httpx.post(f"{strict.base_url}/inference/v1/generate", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "max_tokens"


def test_declared_fields_and_nested_vendor_keys_are_served(strict: ServerProcess) -> None:
    """OpenAI's bookkeeping fields, vLLM's sampling extras and Dynamo's nvext pass; so do keys
    nested in a message (only the top level is checked)."""
    messages = [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]
    extra = {"top_k": 5, "min_tokens": 1, "ignore_eos": True, "nvext": {"greed_sampling": True, "x": 1}}
    answer = oai(strict).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        metadata={"who": "test"},
        store=False,
        service_tier="auto",
        user="u",
        extra_body=extra,
    )
    assert answer.usage.completion_tokens == 3


def test_openapi_document_forbids_undeclared_fields(strict: ServerProcess) -> None:
    doc = httpx.get(f"{strict.base_url}/openapi.json", timeout=60).json()
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest"):
        assert schemas[name]["additionalProperties"] is False, name


def test_ignore_serves_requests_with_unknown_fields(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = echo_core_args(tiny_model, MODEL, "--http-unknown-fields", "ignore")
    with running_server(args, log_dir=tmp_path_factory.mktemp("logs")) as proc:
        answer = oai(proc).chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=2, extra_body={"include_stop_str_in_output": True}
        )
        assert answer.usage.completion_tokens == 2
        doc = httpx.get(f"{proc.base_url}/openapi.json", timeout=60).json()
        assert "additionalProperties" not in doc["components"]["schemas"]["ChatCompletionRequest"]
