"""`dyngraph ls` with real supervisors: every graph running on the machine (here: in this test's
own registry), its state and frontend, a graph whose supervisor died, and none once all are down."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.support.local_graph import Graph
from tests.support.processes import pid_alive, run_cli
from tests.support.waiting import wait_for


def _ls(env: dict[str, str]) -> list[dict]:
    done = run_cli(["ls", "--json"], env=env, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_ls_lists_running_graphs(tmp_path: Path, tiny_model: Path) -> None:
    env = {"DYNGRAPH_REGISTRY": str(tmp_path / "registry")}
    graphs = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        graphs.append(Graph("echo.yaml", tmp_path / folder, tiny_model))
    first, second = graphs
    try:
        assert _ls(env) == []
        for graph in (first, second):
            up = run_cli(
                ["up", "-d", str(graph.file), *graph.overrides, "components.backend.replicas=1"], env=env
            )
            assert up.returncode == 0, up.stdout + up.stderr
        rows = {row["file"]: row for row in _ls(env)}
        assert rows.keys() == {str(first.file), str(second.file)}
        for graph in (first, second):
            row = rows[str(graph.file)]
            assert row["graph"] == "ci-echo" and row["state"] == "running"
            assert row["processes"] == {"ready": 2}
            assert row["urls"] == [f"http://127.0.0.1:{graph.port}/v1"]
        table = run_cli(["ls"], env=env, timeout=30)
        assert table.returncode == 0 and "ci-echo" in table.stdout and "running" in table.stdout

        # the second supervisor is killed: its processes are still listed, as left behind
        supervisor = rows[str(second.file)]["supervisor_pid"]
        os.kill(supervisor, signal.SIGKILL)
        wait_for(lambda: not pid_alive(supervisor), 5, "the supervisor to die")
        gone = {row["file"]: row for row in _ls(env)}[str(second.file)]
        assert gone["state"] == "supervisor gone" and gone["processes"] == {"left running": 2}

        for graph in (first, second):
            down = run_cli(["down", str(graph.file)], env=env, timeout=90)
            assert down.returncode == 0, down.stdout + down.stderr
        assert _ls(env) == []
        assert "no graph is running" in run_cli(["ls"], env=env).stdout
    finally:
        for graph in graphs:
            run_cli(["down", str(graph.file)], env=env, timeout=90)
