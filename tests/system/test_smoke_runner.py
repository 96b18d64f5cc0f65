"""`dyngraph test` on real processes: graphs brought up isolated by the supervisor, checked over
HTTP, torn down. Each test runs the real CLI in a subprocess and then checks for itself that no
process the run started is alive and none of its ports listens (from the state dir the run
keeps with --keep-state, or keeps by itself on failure)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dynamo_graph.graph.targets.local.ports import listening, plan_ports
from dynamo_graph.graph.targets.local.process import pid_alive
from dynamo_graph.graph.targets.local.state import StateDir
from tests.support.processes import DYNGRAPH, run_cli

REPO = Path(__file__).resolve().parents[2]
KEPT = re.compile(r"state and logs kept in (\S+)")

ECHO_GRAPH = """\
name: smoke
models:
  tiny-model:
    path: {model}
components:
  frontend:
    kind: frontend
    http:
      port: {port}
    depends_on: [backend]
  backend:
    kind: worker
    model: tiny-model
    engine: {engine}
    replicas: 2
    env:
      DYN_TOKEN_ECHO_DELAY_MS: {delay_ms}
"""

CHECKS = """\
tests:
  - name: chat echoes
    chat:
      prompt: The smoke test says hello
      max_tokens: 64
    repeat: 2
    expect:
      contains: The smoke test says hello
      finish_reason: stop
  - name: requests counted
    metrics:
      - dynamo_frontend_requests_total{model="tiny-model"} >= 2
"""


def write_graph(
    path: Path,
    model: Path,
    *,
    tests: str = CHECKS,
    port: int = 18180,
    engine: str = "echo_core",
    delay_ms: int = 0,
) -> Path:
    path.write_text(ECHO_GRAPH.format(model=model, port=port, engine=engine, delay_ms=delay_ms) + tests)
    return path


def smoke_cli(*args: str | Path, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return run_cli(["test", *map(str, args)], timeout=timeout)


def kept_states(output: str) -> list[StateDir]:
    return [StateDir(p) for p in KEPT.findall(output)]


def assert_nothing_left(state: StateDir) -> None:
    """Every process the run recorded is gone, and no port of its plan listens; then the state
    dir goes."""
    records = state.read_processes()
    assert records, f"no process records in {state.root}"
    alive = [r.name for r in records if r.pid is not None and pid_alive(r.pid, r.start_ticks)]
    plan = state.read_plan()
    assert plan is not None
    ports = [p for p in plan_ports(plan) if listening(p)]
    assert not alive and not ports, f"left running: {alive}, ports {ports}"
    assert state.supervisor() is None
    shutil.rmtree(state.root)  # kept by the run for this check (a failing test leaves it to look at)


def junit_cases(path: Path) -> dict[str, ET.Element]:
    return {case.get("name", ""): case for case in ET.parse(path).getroot().iter("testcase")}


def test_passing_graph_exit_0_junit_and_nothing_left(tiny_model: Path, tmp_path: Path) -> None:
    graph = write_graph(tmp_path / "smoke.yaml", tiny_model)
    junit = tmp_path / "reports" / "junit.xml"
    result = smoke_cli(graph, "--junit", junit, "--keep-state")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "✓ chat echoes" in result.stdout and "1 passed" in result.stdout
    cases = junit_cases(junit)
    assert set(cases) == {"chat echoes", "requests counted"}
    assert all(len(case) == 0 or case[0].tag == "system-out" for case in cases.values())
    root = ET.parse(junit).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("2", "0", "0")
    (state,) = kept_states(result.stdout)
    assert_nothing_left(state)
    assert not (tmp_path / ".dyngraph").exists(), "a test run never touches the graph's own state dir"


def test_a_failing_check_exits_1_and_junit_names_it(tiny_model: Path, tmp_path: Path) -> None:
    failing = (
        CHECKS
        + """\
  - name: expects what the echo never says
    chat:
      prompt: hello
      max_tokens: 4
    expect:
      contains: goodbye
      completion_tokens: 5
  - name: too slow
    chat:
      prompt: The smoke test says hello, slowly
      max_tokens: 64
    timeout_s: 0.2
  - name: still runs after a failure
    completion:
      prompt: hello
      max_tokens: 4
    expect:
      completion_tokens: 4
"""
    )
    graph = write_graph(tmp_path / "smoke.yaml", tiny_model, tests=failing, delay_ms=25)
    junit = tmp_path / "junit.xml"
    result = smoke_cli(graph, "--junit", junit)
    assert result.returncode == 1, result.stdout + result.stderr
    cases = junit_cases(junit)
    failure = cases["expects what the echo never says"].find("failure")
    assert failure is not None
    assert failure.get("message", "").startswith(
        "expects what the echo never says: text does not contain 'goodbye'"
    )
    assert "completion_tokens 4, expected 5" in (failure.text or "")
    slow = cases["too slow"].find("failure")
    assert slow is not None and slow.get("message") == "too slow: no answer within 0.2 s (timeout_s)"
    assert cases["still runs after a failure"].find("failure") is None
    assert cases["chat echoes"].find("failure") is None
    (state,) = kept_states(result.stdout)  # kept because a check failed
    assert_nothing_left(state)


def test_a_worker_that_cannot_start_exits_2_with_its_log(tiny_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken_engine.py"
    broken.write_text("raise SystemExit('this engine refuses to start: no accelerator found')\n")
    graph = write_graph(tmp_path / "smoke.yaml", tiny_model, engine=str(broken))
    junit = tmp_path / "junit.xml"
    started = time.monotonic()
    result = smoke_cli(graph, "--junit", junit)
    assert result.returncode == 2, result.stdout + result.stderr
    assert time.monotonic() - started < 60, "a worker that cannot start fails the run at once, no crash loop"
    assert "did not come up: backend-" in result.stdout
    assert "this engine refuses to start: no accelerator found" in result.stdout
    error = junit_cases(junit)["up"].find("error")
    assert error is not None and "no accelerator found" in (error.text or "")
    (state,) = kept_states(result.stdout)
    assert_nothing_left(state)


def test_an_invalid_graph_exits_2_with_file_line_and_starts_nothing(tiny_model: Path, tmp_path: Path) -> None:
    bad = """\
tests:
  - name: two kinds at once
    chat: {prompt: hi}
    completion: {prompt: hi}
  - metrics: ['dynamo_frontend_requests_total >> 3']
  - fault: {kill: backend, replica: 5}
  - chat: {prompt: hi}
    expect: {ttft_s: 1}
"""
    graph = write_graph(tmp_path / "invalid-smoke.yaml", tiny_model, tests=bad)
    junit = tmp_path / "junit.xml"
    result = smoke_cli(graph, "--junit", junit)
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout
    assert f"{graph}:21: tests.0.completion: give exactly one of" in out
    assert f"{graph}:22: tests.1.metrics: " in out and "is not `NAME" in out
    assert f"{graph}:25: tests.3.expect.ttft_s: a time to first token needs `stream: true`" in out
    error = junit_cases(junit)["validate"].find("error")
    assert error is not None and "tests.0.completion" in (error.text or "")
    assert "up in" not in out
    assert not list(Path(tempfile.gettempdir()).glob("dyngraph-test-invalid-smoke-*")), "nothing was started"


def test_a_graph_without_tests_gets_the_default_checks_with_its_api_key(
    tiny_model: Path, tmp_path: Path
) -> None:
    graph = write_graph(tmp_path / "smoke.yaml", tiny_model, tests="")
    text = graph.read_text().replace(
        "depends_on: [backend]\n", "depends_on: [backend]\n    api_key_env: [SMOKE_KEY]\n"
    )
    graph.write_text(text)
    junit = tmp_path / "junit.xml"
    env = {"SMOKE_KEY": "sk-smoke-1,sk-smoke-2"}
    result = run_cli(["test", str(graph), "--junit", str(junit)], env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(junit_cases(junit)) == ["models listed", "chat", "chat, streamed", "completion"]


def test_sigint_mid_run_tears_everything_down(tiny_model: Path, tmp_path: Path) -> None:
    slow = """\
tests:
  - name: a slow answer
    chat:
      prompt: The smoke test says hello, slowly, token after token after token.
      max_tokens: 200
"""
    graph = write_graph(tmp_path / "smoke.yaml", tiny_model, tests=slow, delay_ms=200)
    proc = subprocess.Popen(
        [*DYNGRAPH, "test", str(graph), "--keep-state", "--junit", str(tmp_path / "junit.xml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # bounded: the process ends by itself within the checks' time
            lines.append(line)
            if "up in" in line:
                break
        time.sleep(0.5)  # the slow request is in flight
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "interrupted" in output
    (state,) = kept_states(output)
    assert_nothing_left(state)
    error = junit_cases(tmp_path / "junit.xml")["interrupted"].find("error")
    assert error is not None


def test_two_runs_of_one_graph_at_once_both_pass(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:  # the graph's own port is busy (a graph `up` on it, say)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        graph = write_graph(tmp_path / "smoke.yaml", tiny_model, port=port)
        env = {**os.environ, "DYN_TOKEN_ECHO_DELAY_MS": "0"}
        cmd = [*DYNGRAPH, "test", str(graph), "--keep-state"]
        procs = [
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for _ in range(2)
        ]
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=120)[0])
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output
    states = [s for output in outputs for s in kept_states(output)]
    assert len({s.root for s in states}) == 2
    for state in states:
        assert_nothing_left(state)


@pytest.mark.slow
def test_every_ci_and_example_graph_passes(tiny_model: Path, tmp_path: Path) -> None:
    """The shipped graphs: graphs/ci/* (with their checks) and the examples that run without
    vLLM or a GPU (default checks); llama.cpp's needs llama-cpp-python."""
    ci = sorted((REPO / "graphs" / "ci").glob("*.yaml"))
    result = smoke_cli(
        *ci, "-o", f"models.tiny-model.path={tiny_model}", "--junit", tmp_path / "ci.xml", timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    examples = [REPO / "graphs" / "examples" / n for n in ("agg-from-template.yaml", "disagg-mocker.yaml")]
    try:
        import llama_cpp  # noqa: F401

        examples.append(REPO / "graphs" / "examples" / "disagg-llamacpp.yaml")
    except ImportError:
        pass
    env = {"DYNGRAPH_MODEL": str(tiny_model), "DYNGRAPH_ENGINE": "echo_core"}
    result = run_cli(
        ["test", *map(str, examples), "-o", f"models.llm.path={tiny_model}"], env=env, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
