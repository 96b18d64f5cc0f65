"""`dyngraph run` / `dynamo-run` argument handling, as real subprocesses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import run_cli


def test_unknown_engine_lists_engines() -> None:
    result = run_cli(["run", "in=http", "out=warpdrive", "--model-name", "x"])
    assert result.returncode == 2
    assert "unknown engine 'warpdrive'" in result.stderr
    assert "echo_core" in result.stderr and "echo_full" in result.stderr


def test_vllm_without_a_model_says_so() -> None:
    result = run_cli(["run", "in=http", "out=vllm", "--model-name", "x"])
    assert result.returncode == 2
    assert "out=vllm needs a model" in result.stderr


def test_bad_flag_values_are_named(tmp_path: Path) -> None:
    cases = [
        (["--router-mode", "fastest"], "--router-mode"),
        (["--use-kv-events", "maybe"], "--use-kv-events"),
        (["--http-port", "70000"], "--http-port"),
        (["--num-nodes", "2"], "--leader-addr"),
        (["--node-rank", "3", "--num-nodes", "2", "--leader-addr", "127.0.0.1:1"], "--node-rank"),
        (["--context-length", "0"], "--context-length"),
        (["--extra-engine-args", str(tmp_path / "missing.json")], "missing.json"),
    ]
    for flags, named in cases:
        result = run_cli(["run", "in=http", "out=echo_full", *flags])
        assert result.returncode == 2, (flags, result.stderr)
        assert named in result.stderr, (flags, result.stderr)


def test_extra_engine_args_must_be_a_json_object(tmp_path: Path) -> None:
    bad = tmp_path / "args.json"
    bad.write_text("[1, 2]")
    result = run_cli(["run", "in=http", "out=echo_full", "--extra-engine-args", str(bad)])
    assert result.returncode == 2
    assert "must hold a mapping" in result.stderr


def test_unknown_input_and_missing_batch_file() -> None:
    result = run_cli(["run", "in=telepathy", "out=echo_full"])
    assert result.returncode == 2 and "unknown input 'telepathy'" in result.stderr
    result = run_cli(["run", "in=batch:/nonexistent/prompts.jsonl", "out=echo_full"])
    assert result.returncode == 2 and "no such file" in result.stderr


def test_echo_core_needs_a_model() -> None:
    result = run_cli(["run", "in=http", "out=echo_core"])
    assert result.returncode == 2
    assert "--model-path" in result.stderr


def test_missing_model_path_is_named() -> None:
    result = run_cli(["run", "in=http", "out=echo_core", "/nonexistent/model-dir"])
    assert result.returncode == 2
    assert "/nonexistent/model-dir" in result.stderr


def test_flags_without_effect_are_reported(tiny_model: Path) -> None:
    result = run_cli(
        ["run", "out=echo_core", str(tiny_model), "--router-mode", "kv", "--migration-limit", "2"],
        input_text="hello\n",
    )
    assert result.returncode == 0, result.stderr
    assert "--router-mode" in result.stderr and "--migration-limit" in result.stderr
    assert "no effect" in result.stderr


def test_dynamo_run_alias(tiny_model: Path) -> None:
    exe = shutil.which("dynamo-run", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("the dynamo-run console script is not installed next to the interpreter")
    result = subprocess.run(
        [exe, "out=echo_core", str(tiny_model)],
        input="Hi there\n",
        capture_output=True,
        text=True,
        timeout=60,
        env={"DYN_TOKEN_ECHO_DELAY_MS": "0", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert "<|start_header_id|>user<|end_header_id|>" in result.stdout
    assert "Hi there" in result.stdout


def test_gguf_model_serves_with_its_embedded_template(tiny_model: Path) -> None:
    gguf = tiny_model / "tiny-llama-f32.gguf"
    result = run_cli(["run", "out=echo_core", str(gguf)], input_text="Hi there\n")
    assert result.returncode == 0, result.stderr
    assert "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>" in result.stdout


def test_batch_with_echo_core_returns_whole_templates_in_order(tiny_model: Path, tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"question number {i}"}) for i in range(100)]
    lines[41] = "{not json"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    result = run_cli(["run", f"in=batch:{prompts}", "out=echo_core", str(tiny_model)], timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"{prompts}:42:" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert len(rows) == 99
    expected = [i for i in range(100) if i != 41]
    assert [row["text"] for row in rows] == [f"question number {i}" for i in expected]
    for row in rows:
        # ignore_eos is set for echo engines, so the whole template comes back.
        assert row["response"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert row["tokens_in"] == row["tokens_out"]


def test_bad_runtime_settings_are_named(tiny_model: Path) -> None:
    cases = [
        (["--discovery-backend", "consul"], {}, "consul"),
        (["--request-plane", "carrier-pigeon"], {}, "carrier-pigeon"),
        (["--event-plane", "kafka"], {}, "kafka"),
        ([], {"DYN_LEASE_TTL": "soon"}, "DYN_LEASE_TTL"),
        ([], {"DYN_TCP_PORT": "http"}, "DYN_TCP_PORT"),
        ([], {"DYN_DISCOVERY_BACKEND": "zookeeper"}, "DYN_DISCOVERY_BACKEND"),
    ]
    for flags, env, named in cases:
        result = run_cli(["run", "in=dyn://x.y.z", "out=echo_core", str(tiny_model), *flags], env=env)
        assert result.returncode == 2, (flags, env, result.stderr)
        assert named in result.stderr, (flags, env, result.stderr)
        assert "Traceback" not in result.stderr
