"""The OpenAPI document tells the truth: Schemathesis, a fuzzer nobody here wrote, runs with every
check (positive and negative data, schema conformance, status codes, content types, 405s and
`Allow`, auth) against a real frontend with an echo worker and an embedding worker, once with API
keys off and once with them on, and must report nothing.

The deliberate deviations (refusals that depend on the model named: its context, vocabulary,
chat template, engine) are named with their reasons in tests/support/schemathesis_hooks.py.
Bounded in examples per operation and in time; `make fuzz-api` runs the same against a frontend
of your own, with more examples.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import instances
from tests.support.waiting import wait_for

SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
EMBED = "tiny-embed"
KEY = "sk-fuzz-key"
REPO = Path(__file__).resolve().parents[2]
MAX_EXAMPLES = 12  # per operation and phase: the whole test stays within a few minutes on 2 loaded cores
RUN_LIMIT_S = 150  # one schemathesis run, at most


def fuzz_argv(base_url: str, *extra: str) -> list[str]:
    """`schemathesis run` with every check, less its positive_data_acceptance (the hooks' version
    of it, which knows the named deviations, runs instead)."""
    return [
        SCHEMATHESIS,
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--mode",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "20261127",
        "--request-timeout",
        "20",
        "--workers",
        "1",
        "--no-color",
        *extra,
    ]


@pytest.fixture(scope="module")
def graph(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Two frontends over the same workers (an echo worker, a mocker embedding worker): one open,
    one with an API key."""
    tmp = tmp_path_factory.mktemp("openapi-fuzz")
    planes = embedded_planes_env(tmp)
    args = tmp / "mocker.json"
    args.write_text(json.dumps({"speedup_ratio": 100.0, "embedding_dim": 8}))
    echo = [*DYNGRAPH, "run", "in=dyn://fz.echo.generate", "out=echo_core", str(tiny_model)]
    emb = [*DYNGRAPH, "run", "in=dyn://fz.emb.generate", "out=mocker", str(tiny_model), "--embedding"]
    emb += ["--model-name", EMBED, "--extra-engine-args", str(args)]
    workers = [WorkerProcess(argv, env=planes, log_dir=tmp) for argv in (echo, emb)]
    fronts = {
        "open": ServerProcess(["out=auto"], env=planes, log_dir=tmp),
        "keys": ServerProcess(["out=auto"], env={**planes, "DYN_API_KEY": KEY}, log_dir=tmp),
    }
    try:
        for front in fronts.values():
            front.wait_ready(path="/live", timeout=60)
        open_front = fronts["open"]
        for model in (tiny_model.name, EMBED):
            wait_for(lambda m=model: len(instances(open_front, m)) == 1, 60, f"{model}'s worker")
        wait_for(
            lambda: fronts["keys"].proc.poll() is None and _served(fronts["keys"]) == 2, 60, "both models"
        )
        yield fronts
    finally:
        for proc in [*fronts.values(), *workers]:
            proc.stop()


def _served(front: ServerProcess) -> int:
    models = httpx.get(f"{front.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    return len(models.json()["data"]) if models.status_code == 200 else 0


def _fuzz(base_url: str, tmp_path: Path, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks"}
    argv = fuzz_argv(base_url, *extra)
    run = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S, check=False
    )
    report = run.stdout + run.stderr
    failures = report.find("= FAILURES =")
    assert run.returncode == 0, report[failures : failures + 12000] if failures >= 0 else report[-12000:]
    assert "No issues found" in report or " passed" in report, report[-3000:]


@pytest.mark.parametrize("keys", ["open", "keys"])
def test_schemathesis_finds_nothing(graph: dict[str, ServerProcess], keys: str, tmp_path: Path) -> None:
    front = graph[keys]
    doc = httpx.get(f"{front.base_url}/openapi.json", timeout=10).json()
    operations = {path for path, item in doc["paths"].items() for method in item}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert path in operations
    for path in ("/v1/embeddings", "/inference/v1/generate", "/v1/models", "/health"):
        assert path in operations
    if keys == "keys":
        assert doc["components"]["securitySchemes"]
        _fuzz(front.base_url, tmp_path, "--header", f"Authorization: Bearer {KEY}")
    else:
        assert "securitySchemes" not in doc["components"]
        _fuzz(front.base_url, tmp_path)
    assert front.proc.poll() is None
    assert "Traceback" not in front.log(), front.log()[-3000:]
