"""API keys on the frontend: missing / wrong / right keys with raw httpx and the official openai
client; the probes stay open; the keys never show in logs, metrics, model lists, cards or
`dyngraph render`."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.processes import ServerProcess, echo_core_args, run_cli, running_server

FLAG_KEYS = ("sk-flag-1f2e3d4c5b6a", "sk-flag-second-99887766")
ENV_KEY = "sk-env-0a1b2c3d4e5f"  # via DYN_API_KEY_ENV=MY_FRONTEND_KEY, as a graph passes it
WRONG = "sk-wrong-000000000000"
ALL_KEYS = (*FLAG_KEYS, ENV_KEY)
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = echo_core_args(
        tiny_model,
        "tiny",
        "--api-key",
        ",".join(FLAG_KEYS),
        "-vv",  # the most verbose logging: still no keys
    )
    env = {"DYN_API_KEY_ENV": "MY_FRONTEND_KEY", "MY_FRONTEND_KEY": ENV_KEY}
    with running_server(args, env=env, log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


def _chat(server: ServerProcess, headers: dict[str, str]) -> httpx.Response:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=10)


@pytest.mark.parametrize(
    ("headers", "missing"),
    [
        ({}, True),
        ({"Authorization": f"Bearer {WRONG}"}, False),
        ({"Authorization": f"Basic {FLAG_KEYS[0]}"}, True),
        ({"Authorization": "Bearer"}, False),
        ({"Authorization": f"Bearer {FLAG_KEYS[0]}x"}, False),
        ({"x-api-key": WRONG}, False),
    ],
)
def test_missing_or_wrong_key_is_401_with_an_openai_body(
    server: ServerProcess, headers: dict[str, str], missing: bool
) -> None:
    for resp in (_chat(server, headers), httpx.get(f"{server.base_url}/v1/models", headers=headers)):
        assert resp.status_code == 401
        assert resp.headers["www-authenticate"] == "Bearer"
        error = resp.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert ("didn't provide" in error["message"]) == missing
        assert all(key not in resp.text for key in (*ALL_KEYS, WRONG))


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_configured_key_is_accepted(server: ServerProcess, key: str) -> None:
    assert _chat(server, {"Authorization": f"Bearer {key}"}).status_code == 200
    assert _chat(server, {"x-api-key": key}).status_code == 200
    models = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]


def test_probes_and_metrics_stay_open(server: ServerProcess) -> None:
    for path in ("/health", "/live", "/metrics"):
        assert httpx.get(f"{server.base_url}{path}", timeout=5).status_code == 200, path


def test_openai_client(server: ServerProcess) -> None:
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=WRONG, max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=ENV_KEY, max_retries=0, timeout=10)
    reply = good.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "length"
    chunks = list(good.completions.create(model="tiny", prompt="hello there", max_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in good.models.list()] == ["tiny"]


def test_keys_never_show_in_outputs(server: ServerProcess) -> None:
    # Some traffic with every kind of key first, so there is something to log.
    for key in (*ALL_KEYS, WRONG):
        _chat(server, {"Authorization": f"Bearer {key}"})
    headers = {"Authorization": f"Bearer {FLAG_KEYS[0]}"}
    outputs = {
        "log": server.log(),
        "metrics": httpx.get(f"{server.base_url}/metrics").text,
        "health": httpx.get(f"{server.base_url}/health").text,
        "models": httpx.get(f"{server.base_url}/v1/models", headers=headers).text,
        "openapi": httpx.get(f"{server.base_url}/openapi.json").text,
    }
    assert "401 for POST /v1/chat/completions" in outputs["log"]  # debug logging is on
    for name, text in outputs.items():
        for key in (*ALL_KEYS, WRONG):
            assert key not in text, f"{name} shows a key"
    assert 'dynamo_frontend_rejected_requests_total{reason="unauthorized"}' in outputs["metrics"]


def test_a_named_key_variable_that_is_unset_stops_the_frontend(tiny_model: Path, tmp_path: Path) -> None:
    """A frontend meant to be protected must not come up open."""
    proc = ServerProcess(
        ["out=echo_core", "--model-path", str(tiny_model)],
        env={"DYN_API_KEY_ENV": "NOT_SET_ANYWHERE_KEY"},
        log_dir=tmp_path,
    )
    try:
        assert proc.proc.wait(timeout=30) == 2
        assert "NOT_SET_ANYWHERE_KEY" in proc.log()
    finally:
        proc.stop()


def test_model_cards_carry_no_key(tiny_model: Path) -> None:
    import msgspec

    from dynamo_graph.backend.engine import EngineConfig
    from dynamo_graph.backend.worker import make_card
    from dynamo_graph.llm.model_source import resolve_model
    from dynamo_graph.process.run_config import parse_run_config

    run = parse_run_config(["--model-path", str(tiny_model), "--api-key", FLAG_KEYS[0]])
    cfg = run.worker_config("dyn://dynamo.backend.generate")
    model = resolve_model(str(tiny_model))
    for card in (
        make_card(cfg, "echo_core", EngineConfig(model_input="tokens"), model),
        make_card(cfg, "echo_core", EngineConfig(model_input="text"), None),
    ):
        assert FLAG_KEYS[0] not in msgspec.json.encode(card).decode()


GRAPH = """\
name: secrets
models:
  tiny: {{path: {model}}}
runtime: {{request_plane: nats}}
infra:
  nats: {{url: "nats://alice:pw-{secret}@127.0.0.1:4222"}}
components:
  frontend:
    kind: frontend
    api_key_env: [MY_FRONTEND_KEY]
    auth: {{keys_file: keys.yaml}}
    env: {{HF_TOKEN: hf-{secret}, PLAIN: visible}}
  backend:
    kind: worker
    engine: echo_core
    model: tiny
    env: {{OPENAI_API_KEY: sk-{secret}, DB_PASSWORD: pw2-{secret}}}
"""


@pytest.mark.parametrize("fmt", ["yaml", "json", "shell", "mermaid"])
def test_render_shows_no_secrets(tiny_model: Path, tmp_path: Path, fmt: str) -> None:
    secret = "s3cr3t-value-42"
    graph = tmp_path / "g.yaml"
    graph.write_text(GRAPH.format(model=tiny_model, secret=secret))
    key_hash = hashlib.sha256(secret.encode()).hexdigest()
    (tmp_path / "keys.yaml").write_text(f"keys:\n  - name: team\n    key_sha256: {key_hash}\n")
    result = run_cli(["render", str(graph), "--format", fmt], env={"MY_FRONTEND_KEY": ENV_KEY}, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert secret not in out and ENV_KEY not in out and key_hash not in out
    if fmt != "mermaid":
        assert "***" in out and "visible" in out
        assert "MY_FRONTEND_KEY" in out  # the variable's name, so the plan says where keys come from
        assert str(tmp_path / "keys.yaml") in out  # the keys file's path, never what it holds
