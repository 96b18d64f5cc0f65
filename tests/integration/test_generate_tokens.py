"""Token-in/token-out: `POST /inference/v1/generate` (vLLM's request and response shapes).

Against the mocker (deterministic ids per prompt, log-probabilities) and echo_core (which streams
the prompt's ids back, so stop ids, min_tokens and max_tokens can be placed exactly).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.metrics import metric
from tests.support.processes import ServerProcess, echo_core_args, running_server

PATH = "/inference/v1/generate"
PROMPT = [0, 17, 42, 300, 301, 302, 7]


@pytest.fixture(scope="module")
def mocker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args_file = tmp_path_factory.mktemp("args") / "mocker.json"
    args_file.write_text(json.dumps({"speedup_ratio": 100.0}))
    args = ["out=mocker", "--model-path", str(tiny_model), "--model-name", "tok"]
    args += ["--extra-engine-args", str(args_file), "--api-key", "sekret"]
    with running_server(args, log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


@pytest.fixture(scope="module")
def echo(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(echo_core_args(tiny_model, "echo"), log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


AUTH = {"authorization": "Bearer sekret"}


def generate(server: ServerProcess, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}{PATH}", json=body, headers=headers or AUTH, timeout=30)


def streamed(server: ServerProcess, body: dict, headers: dict | None = None) -> list[dict]:
    events = []
    with httpx.stream(
        "POST", f"{server.base_url}{PATH}", json={**body, "stream": True}, headers=headers or AUTH, timeout=30
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        events.append(json.loads(line[6:]))
    return events


def test_unary_and_streamed_ids_agree_with_logprobs(mocker: ServerProcess) -> None:
    body = {"model": "tok", "token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "logprobs": 2}}
    whole = generate(mocker, body)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    assert answer["usage"]["prompt_tokens"] == len(PROMPT)
    assert answer["usage"]["completion_tokens"] == 6
    events = streamed(mocker, {**body, "stream_options": {"include_usage": True}})
    ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert ids == choice["token_ids"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert len({e["request_id"] for e in events}) == 1


def test_model_may_be_left_out_when_one_is_served(mocker: ServerProcess) -> None:
    response = generate(mocker, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tok"


def test_needs_the_api_key(mocker: ServerProcess) -> None:
    assert generate(mocker, {"token_ids": PROMPT}, headers={"x-none": "1"}).status_code == 401


def test_stop_ids_min_tokens_and_max_tokens(echo: ServerProcess) -> None:
    # echo_core streams the prompt back: the output is PROMPT, so its ids are where we put them.
    def run(**sampling: object) -> dict:
        response = generate(echo, {"model": "echo", "token_ids": PROMPT, "sampling_params": sampling})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    stopped = run(stop_token_ids=[300], max_tokens=20)
    assert stopped["token_ids"] == PROMPT[:4]  # the stop id is kept, as vLLM keeps it
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", 300)
    late = run(stop_token_ids=[17, 302], min_tokens=3, max_tokens=20)
    assert late["token_ids"] == PROMPT[:6] and late["stop_reason"] == 302
    assert run(max_tokens=3)["token_ids"] == PROMPT[:3]
    body = {"model": "echo", "token_ids": [0, 17, 4, 42], "sampling_params": {"max_tokens": 20}}
    eos = generate(echo, body).json()["choices"][0]  # 4 is an eos id of the tiny model
    assert (eos["token_ids"], eos["finish_reason"], eos["stop_reason"]) == ([0, 17, 4], "stop", None)
    body["sampling_params"]["ignore_eos"] = True
    assert generate(echo, body).json()["choices"][0]["token_ids"] == [0, 17, 4, 42]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids[1]"),
        ({"token_ids": [1, 999999]}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 100000}}, "sampling_params.max_tokens"),
        ({"token_ids": [1], "sampling_params": {"temperature": 9}}, "sampling_params.temperature"),
        (
            {"token_ids": [1], "sampling_params": {"min_tokens": 9, "max_tokens": 2}},
            "sampling_params.min_tokens",
        ),
        ({"token_ids": [1], "sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
        ({"token_ids": [1], "output_mode": "text"}, "output_mode"),
        ({"model": "nope", "token_ids": [1]}, "model"),
    ],
)
def test_bad_input_names_the_field(echo: ServerProcess, body: dict, param: str) -> None:
    response = generate(echo, {"model": "echo", **body})
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_metrics_label_the_endpoint(mocker: ServerProcess) -> None:
    before = metric(mocker, "dynamo_frontend_requests_total", endpoint="generate")
    assert generate(mocker, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}).status_code == 200
    assert metric(mocker, "dynamo_frontend_requests_total", endpoint="generate") == before + 1
