"""Preflight of `dyngraph up` on this host, with real `dyngraph` subprocesses: each problem that
would make a process crash-loop is found before anything starts, all at once, with file:line and
key, exit 2, within seconds, and nothing is left running or even started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.support.processes import free_port, run_cli

FAST_S = 15.0  # "within seconds", with room for a loaded CI machine


def _write_graph(tmp_path: Path, tiny_model: Path, **components: dict) -> Path:
    graph = {
        "name": "pre",
        "models": {"tiny-model": {"path": str(tiny_model)}},
        "components": {
            "frontend": {"kind": "frontend", "http": {"port": free_port()}},
            "backend": {"kind": "worker", "model": "tiny-model", "engine": "echo_core"},
            **components,
        },
    }
    file = tmp_path / "pre.yaml"
    file.write_text(yaml.safe_dump(graph, sort_keys=False))
    return file


def _line_of(file: Path, text: str) -> int:
    return next(i for i, line in enumerate(file.read_text().splitlines(), 1) if text in line)


def _up(
    file: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = run_cli(["up", str(file), *args], timeout=60, env=env)
    return done, time.monotonic() - started


def _assert_nothing_started(file: Path) -> None:
    state = file.parent / ".dyngraph" / file.stem
    assert not (state / "supervisor.pid").exists()
    records = state / "processes.json"
    assert not records.exists() or json.loads(records.read_text()) == []
    assert list(state.glob("logs/*.log")) == []


@pytest.fixture(params=["-d", "foreground"])
def up_args(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """`up -d` (a supervisor is spawned, then stopped) and `up` in the foreground."""
    yield ["-d"] if request.param == "-d" else []


def test_missing_model_names_its_key_and_how_to_build_the_tiny_model(
    tmp_path: Path, tiny_model: Path, up_args: list[str]
) -> None:
    missing = tmp_path / "models" / "tiny-model"
    file = _write_graph(tmp_path, missing)
    done, elapsed = _up(file, *up_args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert elapsed < FAST_S
    line = _line_of(file, "path:")
    assert f"{file}:{line}: models.tiny-model.path: {missing} does not exist" in done.stderr
    assert f"build the tiny test model there with `dyngraph dev tiny-model {missing}`" in done.stderr
    _assert_nothing_started(file)


def test_a_folder_that_is_not_a_model(tmp_path: Path, tiny_model: Path) -> None:
    folder = tmp_path / "half-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    file = _write_graph(tmp_path, folder)
    done, _ = _up(file, "-d")
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"models.tiny-model.path: {folder} is not a Hugging Face model folder: it has no tokenizer.json"
        in (done.stderr)
    )
    _assert_nothing_started(file)


def test_engine_without_its_extra(tmp_path: Path, tiny_model: Path, up_args: list[str]) -> None:
    # SGLang cannot be installed on these machines (no CUDA): its package is never importable here.
    file = _write_graph(
        tmp_path, tiny_model, sg={"kind": "worker", "model": "tiny-model", "engine": "sglang"}
    )
    done, elapsed = _up(file, *up_args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert elapsed < FAST_S
    line = _line_of(file, "engine: sglang")
    assert (
        f"{file}:{line}: components.sg.engine: engine sglang needs the Python package 'sglang'" in done.stderr
    )
    assert "pip install -e '.[sglang]' in dyngraph's checkout" in done.stderr
    _assert_nothing_started(file)


def test_taken_port(tmp_path: Path, tiny_model: Path, up_args: list[str]) -> None:
    file = _write_graph(tmp_path, tiny_model)
    port = yaml.safe_load(file.read_text())["components"]["frontend"]["http"]["port"]
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        done, elapsed = _up(file, *up_args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert elapsed < FAST_S
    line = _line_of(file, f"port: {port}")
    assert f"{file}:{line}: components.frontend.http.port: port {port} is already taken" in done.stderr
    _assert_nothing_started(file)


def test_missing_env_vars(tmp_path: Path, tiny_model: Path, up_args: list[str]) -> None:
    """An API key variable the frontend names, and one the graph interpolates."""
    file = _write_graph(tmp_path, tiny_model)
    text = file.read_text().replace(
        "kind: frontend\n", "kind: frontend\n    api_key_env: [DYNGRAPH_TEST_UNSET_KEY]\n"
    )
    file.write_text(text + "    env:\n      DYN_TOKEN_ECHO_DELAY_MS: ${env:DYNGRAPH_TEST_UNSET_DELAY}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNGRAPH_TEST_UNSET")}
    done, elapsed = _up(file, *up_args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert elapsed < FAST_S
    assert (
        f"{file}:{_line_of(file, 'DYN_TOKEN_ECHO_DELAY_MS')}: components.backend.env.DYN_TOKEN_ECHO_DELAY_MS"
        in (done.stderr)
    )
    assert "environment variable DYNGRAPH_TEST_UNSET_DELAY is not set" in done.stderr
    _assert_nothing_started(file)

    # With the interpolated one set, preflight finds the API key's variable unset.
    done, _ = _up(file, *up_args, env={**env, "DYNGRAPH_TEST_UNSET_DELAY": "0"})
    assert done.returncode == 2, done.stdout + done.stderr
    line = _line_of(file, "api_key_env")
    assert (
        f"{file}:{line}: components.frontend.api_key_env.0: "
        "environment variable DYNGRAPH_TEST_UNSET_KEY is not set"
    ) in done.stderr
    _assert_nothing_started(file)


def test_every_problem_at_once_and_engine_args_and_keys_files(tmp_path: Path, tiny_model: Path) -> None:
    file = _write_graph(
        tmp_path,
        tmp_path / "nope",
        sg={"kind": "worker", "model": "tiny-model", "engine": "sglang", "engine_args_file": "args.json"},
        frontend={"kind": "frontend", "http": {"port": free_port()}, "auth": {"keys_file": "keys.yaml"}},
    )
    done = run_cli(["validate", "--preflight", str(file)], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 4, done.stderr
    assert f"components.sg.engine_args_file: {tmp_path / 'args.json'} does not exist" in done.stderr
    assert f"components.frontend.auth.keys_file: {tmp_path / 'keys.yaml'} does not exist" in done.stderr
    assert run_cli(["validate", str(file)], timeout=60).returncode == 0  # plain validate reads no host


def _fake_nvidia_smi(tmp_path: Path, body: str) -> dict[str, str]:
    """PATH with an `nvidia-smi` that prints what the real one prints (or fails as it does)."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(f'#!/bin/sh\n[ "$1" = -L ] || exit 2\n{body}\n')
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{smi.parent}:{os.environ['PATH']}"}


ONE_GPU = "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)'"
NO_DRIVER = "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9"


@pytest.mark.parametrize(("smi", "has"), [(ONE_GPU, "has 1"), (NO_DRIVER, "has 0 (nvidia-smi failed")])
def test_gpus_the_placement_needs(tmp_path: Path, tiny_model: Path, smi: str, has: str) -> None:
    """`hosts.local.gpus: 2` is what the graph says, not what the machine has: two replicas of one
    GPU each need GPUs 0 and 1. (A Python engine file: the mocker's GPUs are not required.)"""
    (tmp_path / "gpu.py").write_text("# an engine that would compute on its GPUs; never started here\n")
    file = _write_graph(
        tmp_path,
        tiny_model,
        gpu={
            "kind": "worker",
            "model": "tiny-model",
            "engine": "gpu.py",
            "replicas": 2,
            "gpus": {"per_replica": 1},
        },
    )
    file.write_text(file.read_text() + "hosts:\n  local:\n    gpus: 2\n")
    done = run_cli(["up", "-d", str(file)], timeout=60, env=_fake_nvidia_smi(tmp_path, smi))
    assert done.returncode == 2, done.stdout + done.stderr
    line = _line_of(file, "gpus: 2")
    assert (
        f"{file}:{line}: hosts.local.gpus: host 'local': the placement needs 2 GPU(s) there (gpu-0, gpu-1)"
        in (done.stderr)
    )
    assert has in done.stderr
    _assert_nothing_started(file)

    two = _fake_nvidia_smi(tmp_path, ONE_GPU + "\necho 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)'")
    ok = run_cli(["validate", "--preflight", str(file)], timeout=60, env=two)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_local_interpreter_without_dyngraph(tmp_path: Path, tiny_model: Path) -> None:
    venv = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    file = _write_graph(tmp_path, tiny_model)
    file.write_text(file.read_text() + f"hosts:\n  local:\n    venv: {venv}\n")
    done, elapsed = _up(file, "-d")
    if done.returncode != 2:  # preflight let it through: leave nothing running, then fail
        run_cli(["down", str(file)], timeout=90)
    assert done.returncode == 2, done.stdout + done.stderr
    assert elapsed < FAST_S
    line = _line_of(file, "venv:")
    assert (
        f"{file}:{line}: hosts.local.venv: host 'local': dyngraph is not installed for {venv}/bin/python"
        in (done.stderr)
    )
    _assert_nothing_started(file)


def test_local_processes_run_with_the_graph_s_interpreter(tmp_path: Path, tiny_model: Path) -> None:
    """`hosts.local.python` runs preflight's probe and every local `dyngraph` process."""
    calls = tmp_path / "calls.log"
    wrapper = tmp_path / "bin" / "python-wrapper"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    file = _write_graph(tmp_path, tiny_model)
    file.write_text(file.read_text() + f"hosts:\n  local:\n    python: {wrapper}\n")
    try:
        done, _ = _up(file, "-d")
        assert done.returncode == 0, done.stdout + done.stderr
        lines = calls.read_text().splitlines()
        assert lines[0] == "-m dynamo_graph.graph.targets.local.remote.agent probe"
        runs = sorted(line.split()[3] for line in lines[1:])
        assert runs == ["in=dyn://pre.backend.generate", "in=http"], lines
    finally:
        assert run_cli(["down", str(file)], timeout=90).returncode == 0


class _Hub(BaseHTTPRequestHandler):
    """A stand-in for the hub's model API: `acme/present` exists, nothing else."""

    def do_GET(self) -> None:
        found = self.path == "/api/models/acme/present"
        self.send_response(200 if found else 401)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"id": "acme/present"}' if found else b'{"error": "Repository not found"}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _hub_graph(tmp_path: Path, repo: str, env: dict[str, str]) -> Path:
    file = _write_graph(tmp_path, tmp_path)
    graph = yaml.safe_load(file.read_text())
    graph["models"]["tiny-model"]["path"] = repo
    graph["components"]["backend"]["env"] = env
    file.write_text(yaml.safe_dump(graph, sort_keys=False))
    return file


@pytest.mark.parametrize(
    ("repo", "setting", "problem"),
    [
        ("acme/cached", "cached", None),
        ("acme/present", "online", None),
        (
            "acme/missing",
            "online",
            "has no such model (or it is private or gated: set HF_TOKEN for the worker)",
        ),
        ("acme/present", "offline", "and HF_HUB_OFFLINE is set: download it where the hub is reachable"),
        ("acme/present", "unreachable", "cannot be reached"),
    ],
)
def test_hub_model_ids(
    tmp_path: Path, tiny_model: Path, hub: str, repo: str, setting: str, problem: str | None
) -> None:
    """A hub id is fine when the worker's HF cache holds it or its hub has it; otherwise exit 2
    with the key, the cache looked in and the way out. The worker's own HF_* env decides."""
    home = tmp_path / "hf"
    snapshot = home / "hub" / "models--acme--cached" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (snapshot / name).write_bytes((tiny_model / name).read_bytes())
    env = {"HF_HOME": str(home), "HF_ENDPOINT": hub}
    if setting == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    if setting == "unreachable":
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    file = _hub_graph(tmp_path, repo, env)
    done = run_cli(["validate", str(file), "--preflight"], timeout=60)
    if problem is None:
        assert done.returncode == 0, done.stdout + done.stderr
        return
    assert done.returncode == 2, done.stdout + done.stderr
    line = _line_of(file, f"path: {repo}")
    where = f"{file}:{line}: models.tiny-model.path: model {repo!r}"
    assert f"{where} is not in the Hugging Face cache ({home / 'hub'})" in done.stderr, done.stderr
    assert problem in done.stderr, done.stderr
