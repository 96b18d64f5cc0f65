"""`python -m dynamo_graph run ...` parses plain command lines without typer (cli/run.py): it must
agree with the typer command on every option, and hand anything unusual to typer."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from dynamo_graph.cli import main as cli_main
from dynamo_graph.cli import run as cli_run


def _typer_run_command() -> Any:
    return typer.main.get_command(cli_main.app).commands["run"]  # type: ignore[attr-defined]


def _base_type(annotation: Any) -> type:
    args = [a for a in typing.get_args(typing.get_args(annotation)[0]) if a is not type(None)]
    return args[0] if args else typing.get_args(annotation)[0]


def test_options_match_the_typer_command() -> None:
    hints = typing.get_type_hints(cli_main.run_command, include_extras=True)
    options, flags = {}, {}
    for param in _typer_run_command().params:
        if param.name == "words":
            continue
        assert cli_run.RUN_DEFAULTS[param.name] == param.default, param.name
        if param.name == "verbose":
            assert param.opts == ["-v", "--verbose"] and param.count
        elif param.is_flag:
            flags[param.opts[0]] = param.name
        else:
            options[param.opts[0]] = (param.name, _base_type(hints[param.name]))
    assert options == cli_run.RUN_OPTIONS
    assert flags == cli_run.RUN_FLAGS
    assert set(cli_run.RUN_DEFAULTS) == {p.name for p in _typer_run_command().params} - {"words"}


def _via_typer(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict, set[str]]:
    seen: list[tuple[list[str], dict, set[str]]] = []

    def fake_execute(words: list[str] | None, params: dict, explicit: set[str]) -> int:
        seen.append((list(words or []), params, explicit))
        return 0

    monkeypatch.setattr(cli_run, "execute", fake_execute)
    result = CliRunner().invoke(cli_main.app, ["run", *args])
    assert result.exit_code == 0, result.output
    return seen[0]


@pytest.mark.parametrize(
    "args",
    [
        [
            "in=dyn://hello.backend.generate",
            "out=echo_core",
            "--model-path",
            "/m/tiny",
            "--model-name",
            "tiny-model",
        ],
        [
            "in=http",
            "out=auto",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "8080",
            "--router-mode",
            "round-robin",
            "--kv-overlap-score-weight",
            "1",
            "--router-temperature",
            "0.5",
            "--use-kv-events",
            "true",
            "--migration-limit",
            "0",
        ],
        ["out=echo_core", "/m/tiny", "--static-worker", "-vv", "--extra-engine-args", "e.json"],
        ["--node-rank=-1", "--context-length=64", "--verbose", "in=none", "out=echo"],
        [],
    ],
)
def test_fast_parse_agrees_with_typer(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_run.parse_fast(args) == _via_typer(args, monkeypatch)


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--http-port", "80x"],
        ["--http-port"],
        ["--bogus", "1"],
        ["--model-name", "-x"],
        ["--router-temperature", "1e-3"],
    ],
)
def test_unusual_command_lines_go_to_typer(args: list[str]) -> None:
    assert cli_run.parse_fast(args) is None


def test_typed_values() -> None:
    parsed = cli_run.parse_fast(["--http-port", "9000", "--extra-engine-args", "a.json"])
    assert parsed is not None
    _, params, explicit = parsed
    assert params["http_port"] == 9000
    assert params["extra_engine_args"] == Path("a.json")
    assert explicit == {"http_port", "extra_engine_args"}


def test_arguments_after_a_double_dash_go_to_the_engine() -> None:
    parsed = cli_run.parse_fast(["in=dyn://a.b.c", "out=pytok:e.py", "--", "--delay-ms", "5", "x"])
    assert parsed is not None
    words, params, _ = parsed
    assert words == ["in=dyn://a.b.c", "out=pytok:e.py"]
    assert params["engine_argv"] == ["--delay-ms", "5", "x"]
