from __future__ import annotations

import json
import logging

import pytest

from dynamo_graph.log import TRACE, LogSpecError, parse_log_spec, setup_logging


def test_rust_log_syntax() -> None:
    assert parse_log_spec("debug") == (logging.DEBUG, {})
    assert parse_log_spec("warn,dynamo_graph.frontend=debug") == (
        logging.WARNING,
        {"dynamo_graph.frontend": logging.DEBUG},
    )
    assert parse_log_spec("dynamo_graph::router=trace") == (logging.INFO, {"dynamo_graph.router": TRACE})
    assert parse_log_spec("") == (logging.INFO, {})
    # A bare target enables everything from it, as RUST_LOG does.
    assert parse_log_spec("error,dynamo_graph.llm") == (logging.ERROR, {"dynamo_graph.llm": TRACE})


def test_bad_level_is_named() -> None:
    with pytest.raises(LogSpecError, match="loud"):
        parse_log_spec("dynamo_graph=loud")


def test_verbosity_flags_lower_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_LOG", raising=False)
    setup_logging(1)
    assert logging.getLogger().level == logging.DEBUG
    setup_logging(2)
    assert logging.getLogger().level == TRACE
    setup_logging(0)
    assert logging.getLogger().level == logging.INFO


def test_jsonl_output(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DYN_LOGGING_JSONL", "1")
    monkeypatch.setenv("DYN_LOG", "info,dynamo_graph.test=debug")
    setup_logging(0)
    logging.getLogger("dynamo_graph.test").debug("hello %s", "world")
    entry = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert entry["message"] == "hello world"
    assert entry["level"] == "DEBUG"
    assert entry["target"] == "dynamo_graph.test"
