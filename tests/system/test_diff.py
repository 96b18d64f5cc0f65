"""`dyngraph diff` and `up --dry-run` against a running CI smoke graph (real supervisor and
processes): they tell what `up` then does, and change nothing themselves; and `up` in the
foreground on that running graph, which attaches to it."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.local_graph import Graph
from tests.support.processes import DYNGRAPH, pid_alive
from tests.support.waiting import wait_for


@pytest.fixture
def graph(tmp_path: Path, tiny_model: Path) -> Iterator[Graph]:
    """The echo smoke graph, brought down at the end whatever happened."""
    made = Graph("echo.yaml", tmp_path, tiny_model)
    yield made
    made.cli("down", timeout=90)


def _changes(out: str) -> list[str]:
    return [line for line in out.splitlines() if line[:2] in ("+ ", "~ ", "- ")]


def test_diff_tells_what_up_does(graph: Graph) -> None:
    not_running = graph.cli("diff", *graph.overrides)
    assert not_running.returncode == 1, not_running.stdout + not_running.stderr
    assert "is not running" in not_running.stdout
    assert _changes(not_running.stdout) == ["+ backend-0", "+ backend-1", "+ frontend-0"]

    up = graph.up("components.backend.replicas=1")
    assert up.returncode == 0, up.stdout + up.stderr
    before = graph.processes()

    same = graph.cli("diff", *graph.overrides, "components.backend.replicas=1")
    assert same.returncode == 0, same.stdout + same.stderr
    assert _changes(same.stdout) == [] and "no changes" in same.stdout

    # replicas 1 -> 2: exactly the added process, for diff and for a dry run, and nothing happens
    for command in (["diff"], ["up", "--dry-run"]):
        scaled = graph.cli(*command, *graph.overrides)
        assert scaled.returncode == 1, scaled.stdout + scaled.stderr
        assert _changes(scaled.stdout) == ["+ backend-1"], scaled.stdout
        assert "backend: replicas 1 -> 2" in scaled.stdout
    assert graph.processes() == before

    # a changed env rolls the backend (new run beside the old one: the frontend depending on it
    # stays); a secret stays hidden
    changed = [
        "components.backend.replicas=1",
        "components.backend.env.DYN_TOKEN_ECHO_DELAY_MS=1",
        "+components.backend.env.DYN_EXAMPLE=on",
        "+components.backend.env.HF_TOKEN=hf_do_not_print_me",
    ]
    diff = graph.cli("diff", *graph.overrides, *changed)
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert _changes(diff.stdout) == ["~ backend-0"]
    assert "    env DYN_EXAMPLE: + on" in diff.stdout
    assert "    env HF_TOKEN: + ***" in diff.stdout and "hf_do_not_print_me" not in diff.stdout
    assert graph.processes() == before

    applied = graph.up(*changed)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert _changes(applied.stdout) == _changes(diff.stdout)
    after = graph.processes()
    assert after["backend-0"]["pid"] != before["backend-0"]["pid"]
    assert after["frontend-0"]["pid"] == before["frontend-0"]["pid"]
    assert graph.chat()
    assert graph.cli("diff", *graph.overrides, *changed).returncode == 0


def test_foreground_up_attaches_to_a_running_graph(graph: Graph, tmp_path: Path) -> None:
    """`up` in the foreground on a graph `up -d` started: the changes are applied, the logs of
    every process follow (interleaved as they come), and Ctrl-C stops the graph."""
    up = graph.up("components.backend.replicas=1")
    assert up.returncode == 0, up.stdout + up.stderr
    output = tmp_path / "attached.out"
    with output.open("wb") as out:
        attached = subprocess.Popen(
            [*DYNGRAPH, "up", str(graph.file), *graph.overrides, "components.backend.replicas=1"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: "attached to its logs" in output.read_text(), 30, "up to attach")
        backend = graph.processes()["backend-0"]["pid"]
        os.kill(backend, signal.SIGKILL)  # the supervisor restarts it: its new run shows up here
        wait_for(lambda: _prefixed(output, "backend-0", "started backend-0 (run 2)"), 30, "its log")
        wait_for(lambda: "restarting" in output.read_text(), 10, "the supervisor's report")
        pids = [r["pid"] for r in graph.processes().values()]
        attached.send_signal(signal.SIGINT)
        assert attached.wait(60) == 0, output.read_text()
    finally:
        if attached.poll() is None:
            attached.kill()
    text = output.read_text()
    assert "no changes" in text and "stopping the graph (Ctrl-C)" in text
    assert not (graph.state / "supervisor.pid").exists()
    wait_for(lambda: not any(pid_alive(p) for p in pids if p), 10, "every process to be gone")


def _prefixed(output: Path, process: str, text: str) -> bool:
    """Whether a line `process | ...text...` was printed."""
    lines = output.read_text().splitlines()
    return any(line.split(" | ")[0].strip() == process and text in line for line in lines)
