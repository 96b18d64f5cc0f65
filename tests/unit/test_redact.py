"""Which names hide their values in rendered plans, diffs and scripts."""

from __future__ import annotations

import pytest

from dynamo_graph.redact import REDACTED, is_secret_name, redact_url


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "OPENAI_API_KEY",
        "--api-key",
        "DYN_APIKEY",
        "NATS_PASSWORD",
        "db.passwd",
        "AWS_SECRET_ACCESS_KEY",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "ssh_private",
        "HTTP_AUTHORIZATION",
        "authToken",
        "key_sha256",
    ],
)
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "--max-tokens",
        "--max-num-batched-tokens",
        "--tokenizer",
        "DYN_TOKEN_ECHO_DELAY_MS",
        "api_key_env",
        "HF_TOKEN_FILE",
        "--router-tracking-key-file",
        "KV_BLOCK_SIZE",
        "MODEL_PATH",
        "DYN_LOG",
        "--api-keys-file",
        "keys_file",
    ],
)
def test_names_that_are_not_secrets(name: str) -> None:
    assert not is_secret_name(name)


def test_url_userinfo_is_masked() -> None:
    assert redact_url("nats://user:pw@10.0.0.1:4222") == f"nats://{REDACTED}@10.0.0.1:4222"
    assert redact_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
