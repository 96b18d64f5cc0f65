"""`dyngraph up | status | down` on real processes: the CI smoke graphs, copied into tmp_path so
their state dir (and every log) lives there. Every test downs its graph in a finally."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.local_graph import Graph
from tests.support.processes import DYNGRAPH, free_port, pid_alive, port_refuses
from tests.support.waiting import wait_for


@pytest.fixture
def make_graph(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[[str], Graph]]:
    """Graphs made here are brought down at the end, whatever happened."""
    made: list[Graph] = []

    def make(source: str) -> Graph:
        graph = Graph(source, tmp_path, tiny_model)
        made.append(graph)
        return graph

    yield make
    for graph in made:
        graph.cli("down", timeout=90)


def assert_all_gone(pids: list[int], ports: list[int]) -> None:
    assert [p for p in pids if pid_alive(p)] == []
    assert [p for p in ports if not port_refuses(p)] == []


def test_up_status_restart_scale_down(make_graph: Callable[[str], Graph]) -> None:
    graph = make_graph("echo.yaml")
    metrics_port = free_port()
    graph.overrides.append(f"supervisor.metrics_port={metrics_port}")
    up = graph.up("components.backend.replicas=1")
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"http://127.0.0.1:{graph.port}/v1" in up.stdout
    assert graph.chat()

    status = graph.cli("status")
    assert status.returncode == 0, status.stderr
    rows = [line for line in status.stdout.splitlines() if "local" in line]
    assert len(rows) == 2 and all("ready" in row for row in rows), status.stdout

    # kill -9 a worker: the supervisor restarts it and the model answers again
    before = graph.processes()
    victim = before["backend-0"]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: (
            graph.processes()["backend-0"]["pid"] not in (None, victim)
            and graph.processes()["backend-0"]["state"] == "ready"
        ),
        20,
        "backend-0 to be restarted",
    )
    assert graph.processes()["backend-0"]["restarts"] == 1
    wait_for(lambda: _answers(graph), 15, "the model to answer after the restart")
    # the supervisor's own /metrics says the same
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    for line in (
        'dyngraph_process_restarts_total{component="backend",process="backend-0"} 1.0',
        'dyngraph_replicas{component="backend",state="ready"} 1.0',
        'dyngraph_desired_replicas{component="frontend"} 1.0',
        "dyngraph_revision 1.0",
        "dyngraph_revision_rolling 0.0",
    ):
        assert line in metrics.splitlines(), metrics

    # replicas 1 -> 3: two added, nothing else restarted
    pids = {name: rec["pid"] for name, rec in graph.processes().items()}
    scaled = graph.up("components.backend.replicas=3")
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    changes = [line for line in scaled.stdout.splitlines() if line[:2] in ("+ ", "~ ", "- ")]
    assert changes == ["+ backend-1", "+ backend-2"], scaled.stdout
    after = graph.processes()
    assert {n: after[n]["pid"] for n in pids} == pids
    assert all(rec["state"] == "ready" for rec in after.values())
    assert graph.chat()

    again = graph.up("components.backend.replicas=3")
    assert again.returncode == 0 and "no changes" in again.stdout

    all_pids = [rec["pid"] for rec in graph.processes().values()]
    down = graph.cli("down", timeout=90)
    assert down.returncode == 0, down.stdout + down.stderr
    assert_all_gone(all_pids, [*graph.ports(), metrics_port])
    assert not (graph.state / "supervisor.pid").exists()
    assert (graph.state / "logs" / "backend-0.log").exists()

    not_running = graph.cli("down")
    assert not_running.returncode == 0 and "not running" in not_running.stdout


def _answers(graph: Graph) -> bool:
    try:
        return bool(graph.chat())
    except Exception:
        return False


def test_managed_etcd_and_nats(make_graph: Callable[[str], Graph]) -> None:
    if not (shutil.which("etcd") and shutil.which("nats-server")):
        if os.environ.get("CI"):  # CI installs them: missing there is a failure, not a skip
            pytest.fail("etcd or nats-server not installed")
        pytest.skip("etcd or nats-server not installed")
    graph = make_graph("echo-etcd-nats.yaml")
    up = graph.up()
    assert up.returncode == 0, up.stdout + up.stderr
    assert graph.chat()
    records = graph.processes()
    assert {"etcd", "nats", "backend-0", "backend-1", "frontend-0"} <= records.keys()
    assert all(rec["state"] == "ready" for rec in records.values())

    pids = [rec["pid"] for rec in records.values()]
    ports = graph.ports()
    assert len(ports) == 6  # the frontend's, etcd client + peer, nats, each worker's /metrics
    down = graph.cli("down", timeout=90)
    assert down.returncode == 0, down.stdout + down.stderr
    assert_all_gone(pids, ports)


def test_foreground_up_stops_on_ctrl_c(make_graph: Callable[[str], Graph], tmp_path: Path) -> None:
    graph = make_graph("echo.yaml")
    with (tmp_path / "foreground.out").open("wb") as out:
        proc = subprocess.Popen(
            [*DYNGRAPH, "up", str(graph.file), *graph.overrides],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(
            lambda: (
                (graph.state / "processes.json").exists()
                and len(graph.processes()) == 3
                and all(r["state"] == "ready" for r in graph.processes().values())
            ),
            30,
            "the graph to be ready",
        )
        assert graph.chat()
        pids = [rec["pid"] for rec in graph.processes().values()]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0  # well within the 10 s grace of each dependency level
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "foreground.out").read_text()
    assert "backend-0  | " in output and "serving model" in output
    assert "all 3 processes ready" in output
    assert_all_gone(pids, graph.ports())


def _broken_model(tmp_path: Path, tiny_model: Path) -> Path:
    """A model folder preflight accepts (tokenizer and config) whose config.json does not parse:
    the worker fails at start, which only a crash loop can tell."""
    folder = tmp_path / "broken-model"
    folder.mkdir()
    shutil.copy(tiny_model / "tokenizer.json", folder)
    (folder / "config.json").write_text("not json")
    return folder


def test_crash_loop_fails_up(make_graph: Callable[[str], Graph], tmp_path: Path) -> None:
    """A worker that dies at start with an ordinary error (exit 1) is retried by its policy."""
    graph = make_graph("echo.yaml")
    dies = "import os, sys\nprint('dies at start', file=sys.stderr, flush=True)\nos._exit(1)\n"
    (tmp_path / "dies.py").write_text(dies)
    up = graph.up(
        "components.backend.replicas=1",
        "components.backend.engine=dies.py",
        "+components.backend.restart.max_restarts=2",
        "+components.backend.restart.backoff_s=0.1",
    )
    assert up.returncode == 1, up.stdout + up.stderr
    assert "backend-0 failed" in up.stdout and "crash loop" in up.stdout
    assert "dies at start" in up.stdout  # the worker's own error, from its log
    assert graph.processes()["backend-0"]["restarts"] == 2
    supervisor_log = (graph.state / "supervisor.log").read_text()
    assert "crash loop" in supervisor_log


def test_start_up_error_fails_up_at_once(make_graph: Callable[[str], Graph], tmp_path: Path) -> None:
    """An engine that raises at import exits with the configuration error code, which a restart
    would repeat: `up -d` reports it at once (issue 31, stumble 9), not after the restart backoff
    (1 + 2 + 4 + 8 + 16 s) or the frontend's readiness timeout."""
    graph = make_graph("echo.yaml")
    (tmp_path / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    started = time.monotonic()
    up = graph.up("components.backend.replicas=1", "components.backend.engine=raises.py")
    took = time.monotonic() - started
    assert up.returncode == 1, up.stdout + up.stderr
    assert "backend-0 failed" in up.stdout and "a restart would repeat" in up.stdout
    assert "RuntimeError: boom at import" in up.stdout  # the worker's own error, from its log
    assert "Traceback" not in up.stdout + up.stderr
    assert graph.processes()["backend-0"]["restarts"] == 0
    assert took < 20, f"reported after {took:.1f} s"


def test_a_start_up_error_after_serving_is_retried(
    make_graph: Callable[[str], Graph], tmp_path: Path
) -> None:
    """A worker that served, died, and fails its restart with the start-up error code (a model
    hub out of reach meanwhile) is retried by its policy, and serves again once the cause is gone."""
    graph = make_graph("echo.yaml")
    marker = tmp_path / "hub-down"
    fails = "import os\nif os.path.exists(os.environ['HUB_DOWN']):\n    raise RuntimeError('hub down')\n"
    engine = (Path(__file__).parents[2] / "examples/pystr_engine.py").read_text()
    (tmp_path / "flaky.py").write_text(fails + engine)
    up = graph.up(
        "components.backend.replicas=1",
        "components.backend.engine=pystr:flaky.py",
        f"+components.backend.env.HUB_DOWN={marker}",
        "+components.backend.restart.max_restarts=20",
        "+components.backend.restart.backoff_s=0.2",
        "+components.backend.restart.backoff_max_s=0.5",
    )
    assert up.returncode == 0, up.stdout + up.stderr
    marker.touch()
    os.kill(graph.processes()["backend-0"]["pid"], signal.SIGKILL)
    wait_for(lambda: graph.processes()["backend-0"]["restarts"] >= 2, 30, "restarts that fail")
    assert graph.processes()["backend-0"]["state"] != "failed"
    marker.unlink()
    wait_for(lambda: graph.processes()["backend-0"]["state"] == "ready", 30, "serving again")


def test_failed_dependency_fails_its_dependents(
    make_graph: Callable[[str], Graph], tmp_path: Path, tiny_model: Path
) -> None:
    """A frontend waiting on a worker that gave up is marked failed, not left `starting`."""
    graph = make_graph("echo.yaml")
    up = graph.up(
        "components.backend.replicas=1",
        f"models.tiny-model.path={_broken_model(tmp_path, tiny_model)}",
        "+components.backend.restart.max_restarts=1",
        "+components.backend.restart.backoff_s=0.1",
        "+components.frontend.depends_on=[backend]",
    )
    assert up.returncode == 1, up.stdout + up.stderr
    records = graph.processes()
    assert records["backend-0"]["state"] == "failed"
    assert records["frontend-0"]["state"] == "failed", records["frontend-0"]
    assert "dependency backend-0 failed" in records["frontend-0"]["message"]
    assert records["frontend-0"]["pid"] is None


def test_changed_spec_restarts_and_dead_supervisor_is_cleaned_up(make_graph: Callable[[str], Graph]) -> None:
    graph = make_graph("echo.yaml")
    assert graph.up("components.backend.replicas=2").returncode == 0
    before = graph.processes()

    changed = graph.up("components.backend.replicas=1", "+components.backend.env.DYN_EXAMPLE=1")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    changes = [line for line in changed.stdout.splitlines() if line[:2] in ("+ ", "~ ", "- ")]
    # backend-0 rolls: its new run starts beside the old one, so the frontend (which depends on
    # it) keeps running and lists the new run before the old one stops
    assert changes == ["~ backend-0", "- backend-1"], changed.stdout
    after = graph.processes()
    assert after["backend-0"]["pid"] != before["backend-0"]["pid"]
    assert after["frontend-0"]["pid"] == before["frontend-0"]["pid"]
    assert after["backend-0"]["revision"] == 2 and after["frontend-0"]["revision"] == 1
    assert "backend-1" not in after and not pid_alive(before["backend-1"]["pid"])
    assert not pid_alive(before["backend-0"]["pid"])
    assert _answers(graph)

    logs = graph.cli("logs", "backend", "-n", "5")
    assert logs.returncode == 0 and "backend-0 | " in logs.stdout and "serving model" in logs.stdout

    # the supervisor dies: `down` still stops what it left behind
    supervisor = json.loads((graph.state / "supervisor.pid").read_text())["pid"]
    os.kill(supervisor, signal.SIGKILL)
    wait_for(lambda: not pid_alive(supervisor), 5, "the supervisor to die")
    pids = [rec["pid"] for rec in after.values()]
    down = graph.cli("down", timeout=90)
    assert down.returncode == 0, down.stdout + down.stderr
    assert_all_gone(pids, graph.ports())


def _disagg_count(graph: Graph, where: str) -> float:
    text = subprocess.run(
        ["curl", "-s", f"http://127.0.0.1:{graph.port}/metrics"], capture_output=True, text=True, timeout=10
    ).stdout
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dynamo_frontend_disagg_prefill_total{") and f'where="{where}"' in line
    )


def test_disaggregated_graph_and_its_prefill_pool_scaled_to_zero(make_graph: Callable[[str], Graph]) -> None:
    graph = make_graph("mocker-disagg.yaml")
    up = graph.up()
    assert up.returncode == 0, up.stdout + up.stderr
    wait_for(lambda: _answers(graph) and _disagg_count(graph, "remote") >= 1, 30, "a remote prefill")
    # Re-up with no prefill replica: the decode worker prefills locally; nothing else restarts.
    decode_pid = graph.processes()["decode-0"]["pid"]
    scaled = graph.up("components.prefill.replicas=0")
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert "prefill-0" not in graph.processes()
    assert graph.processes()["decode-0"]["pid"] == decode_pid
    before = _disagg_count(graph, "local")
    wait_for(lambda: _answers(graph) and _disagg_count(graph, "local") > before, 30, "a local prefill")
