"""`dyngraph bench` on real graphs: mocker workers (high speedup) brought up by the real
supervisor, loaded over real sockets, counted by the frontend's real /metrics. Every graph this
file starts is brought down in a finally; the sweep test checks that bench left nothing running."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import DYNGRAPH, free_port, port_refuses, run_cli

GRAPHS = Path(__file__).resolve().parents[2] / "graphs" / "ci"
WORKLOAD = ["--input-len", "48", "--output-len", "8"]


def copy_graph(tmp_path: Path, tiny_model: Path, port: int | str = "auto") -> tuple[Path, list[str]]:
    file = tmp_path / "mocker-kv.yaml"
    shutil.copy(GRAPHS / "mocker-kv.yaml", file)
    return file, [f"components.frontend.http.port={port}", f"models.tiny-model.path={tiny_model}"]


def served_requests(url: str) -> float:
    """What the frontend's /metrics counted: dynamo_frontend_requests_total, every label."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dynamo_frontend_requests_total"
    )


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30)
    return done.stdout.strip()


def test_bench_a_running_graph_counts_what_its_metrics_count(tmp_path: Path, tiny_model: Path) -> None:
    graph, overrides = copy_graph(tmp_path, tiny_model, free_port())
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", graph.name)
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "graph")
    out = tmp_path / "out"
    up = run_cli(["up", "-d", str(graph), *overrides], timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        done = run_cli(
            [
                "bench",
                str(graph),
                *overrides,
                "-c",
                "1,4",
                "--rate",
                "40",
                "-n",
                "24",
                *WORKLOAD,
                "-o",
                str(out),
            ],
            timeout=180,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads((out / "result.json").read_text())
        counted = served_requests(result["url"])
    finally:
        run_cli(["down", str(graph)], timeout=90)

    points = result["points"]
    assert [p["label"] for p in points] == ["c=1", "c=4", "rate=40/s"]
    assert [p["summary"]["ok"] for p in points] == [24, 24, 24]
    # what the client sent is what the server counted, point by point and in all
    assert sum(p["summary"]["requests"] for p in points) == counted == 72
    assert all(p["server"]["requests"] == p["summary"]["requests"] for p in points)
    # token-exact prompts with the graph model's tokenizer, exact output lengths (ignore_eos)
    assert result["prompts"] == "token ids"
    assert all(p["server"]["input_tokens"] == p["summary"]["prompt_tokens"] == 24 * 48 for p in points)
    assert all(p["summary"]["output_tokens"] == 24 * 8 for p in points)
    # every point its own prompts: none runs on a prefix cache the points before it warmed
    assert len({p["prompts_digest"] for p in points}) == 3
    assert all(p["summary"]["cached_tokens"] == 0 for p in points)
    assert result["workload"]["prompts_per_point"] == "fresh"
    for p in points:
        assert 0 < p["summary"]["ttft_ms"]["p50"] <= p["summary"]["ttft_ms"]["p99"]
        assert p["summary"]["e2e_ms"]["p90"] >= p["summary"]["ttft_ms"]["p90"]
        assert len(p["requests"]) == 24 and p["timeline"]["t_s"]
    # what was measured
    assert result["graph"]["hash"].startswith("sha256:") and result["graph"]["matches_running"] is True
    assert result["graph"]["git"] == {
        "commit": git(tmp_path, "rev-parse", "HEAD"),
        "head": git(tmp_path, "rev-parse", "HEAD"),
        "dirty": False,
    }
    assert result["graph"]["overrides"] == overrides
    assert result["dyngraph_version"] and result["machine"]["cpus"] >= 1
    for name in result["plots"]:
        assert (out / name).stat().st_size > 10_000, name
    assert sorted(result["plots"]) == ["result-latency.png", "result-timeline.png"]
    assert "TTFT" in done.stdout and "rate=40/s" in done.stdout


def test_sweep_over_router_modes_brings_each_up_and_leaves_nothing(tmp_path: Path, tiny_model: Path) -> None:
    graph, overrides = copy_graph(tmp_path, tiny_model)
    out = tmp_path / "sweep"
    modes = "components.frontend.router.mode=kv,round-robin"
    done = run_cli(
        [
            "bench",
            str(graph),
            *overrides,
            "--sweep",
            modes,
            "-c",
            "4",
            "-n",
            "20",
            *WORKLOAD,
            "-o",
            str(out),
            "--plot-format",
            "svg",
        ],
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    sweep = json.loads((out / "sweep.json").read_text())
    variants = sweep["variants"]
    assert [v["overrides"] for v in variants] == [
        ["components.frontend.router.mode=kv"],
        ["components.frontend.router.mode=round-robin"],
    ]
    assert len({v["hash"] for v in variants}) == 2  # different graphs, different hashes
    urls = []
    for variant in variants:
        result = json.loads((out / variant["result"]).read_text())
        assert result["graph"]["hash"] == variant["hash"]
        assert result["graph"]["overrides"] == [*overrides, *variant["overrides"]]
        assert result["variant"]["overrides"] == variant["overrides"]
        assert result["points"][0]["summary"]["ok"] == 20
        assert result["points"][0]["server"]["requests"] == 20  # each variant a fresh graph
        assert all((out / p).exists() for p in result["plots"])
        urls.append(result["url"])
    assert (out / sweep["plot"]).read_text().startswith("<?xml")
    # nothing left running: no supervisor, no process, no frontend port
    state = tmp_path / ".dyngraph" / graph.stem
    assert not (state / "supervisor.pid").exists()
    for record in json.loads((state / "processes.json").read_text()):
        assert record["state"] in ("stopped", "exited"), record
    assert all(port_refuses(int(url.rsplit(":", 1)[1])) for url in urls)
    status = run_cli(["status", str(graph)])
    assert "not running" in status.stdout


def test_bad_input_exits_2_before_anything_starts(tmp_path: Path, tiny_model: Path) -> None:
    graph, overrides = copy_graph(tmp_path, tiny_model)
    state = tmp_path / ".dyngraph" / graph.stem

    neither = run_cli(["bench"])
    assert neither.returncode == 2 and "give a graph file or --url" in neither.stderr

    nobody = run_cli(["bench", "--url", f"http://127.0.0.1:{free_port()}", "-n", "1"])
    assert nobody.returncode == 2 and "/v1/models" in nobody.stderr, nobody.stderr

    not_up = run_cli(["bench", str(graph), *overrides])
    assert not_up.returncode == 2 and "is not running" in not_up.stderr and "dyngraph up -d" in not_up.stderr

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": "many", "output_length": 2}\n')
    bad_trace = run_cli(
        ["bench", str(graph), *overrides, "--sweep", "components.backend.replicas=1,2", "--trace", str(trace)]
    )
    assert bad_trace.returncode == 2 and "trace.jsonl:1" in bad_trace.stderr, bad_trace.stderr

    bad_variant = run_cli(
        ["bench", str(graph), *overrides, "--sweep", "components.frontend.router.mode=kv,fastest"]
    )
    assert bad_variant.returncode == 2, bad_variant.stderr
    assert "router.mode" in bad_variant.stderr and "mocker-kv.yaml:" in bad_variant.stderr

    bad_sweep = run_cli(["bench", str(graph), *overrides, "--sweep", "components.backend.replicas"])
    assert bad_sweep.returncode == 2 and "KEY=V1,V2" in bad_sweep.stderr

    bad_profile = run_cli(["bench", str(graph), *overrides, "--profile", "5:2,4:x"])
    assert bad_profile.returncode == 2 and "'4:x'" in bad_profile.stderr and "--profile" in bad_profile.stderr

    static = ["bench", str(graph), *overrides, "--compare-static", "2"]
    no_autoscale = run_cli([*static, "--profile", "2:2"])
    assert no_autoscale.returncode == 2 and "no worker with `autoscale:`" in no_autoscale.stderr
    two_loads = run_cli([*static, "-c", "1,2"])
    assert two_loads.returncode == 2 and "runs one load" in two_loads.stderr

    assert not (state / "processes.json").exists()  # no variant was brought up


@pytest.mark.slow
def test_trace_replay_against_a_graph(tmp_path: Path, tiny_model: Path) -> None:
    """A mooncake-style trace replayed 4x faster: arrivals follow its timestamps, prompts share
    the trace's hash-id blocks (the prefix cache sees them: cached tokens > 0)."""
    graph, overrides = copy_graph(tmp_path, tiny_model)
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 64, "output_length": 4, "hash_ids": [1, 2, 3, 10 + i]}
        for i in range(30)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    done = run_cli(
        [
            "bench",
            str(graph),
            *overrides,
            "--sweep",
            "components.backend.replicas=1",
            "--trace",
            str(trace),
            "--trace-block-size",
            "16",
            "--trace-speedup",
            "4",
            "-o",
            str(out),
            "--no-plots",
        ],
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(next(out.glob("v1-*.json")).read_text())
    point = result["points"][0]
    assert point["label"] == "trace" and point["summary"]["ok"] == 30
    starts = [r["start_s"] for r in point["requests"]]
    assert starts[-1] >= 29 * 0.1 / 4 - 0.01  # not sooner than the trace says
    assert point["summary"]["cached_tokens"] > 0


def test_ctrl_c_mid_sweep_brings_the_variant_down(tmp_path: Path, tiny_model: Path) -> None:
    graph, overrides = copy_graph(tmp_path, tiny_model)
    state = tmp_path / ".dyngraph" / graph.stem
    # slow workers and a long load, so that the interrupt lands while requests are in flight
    slow = "components.backend.engine_args.speedup_ratio=0.2"
    proc = subprocess.Popen(
        [
            *DYNGRAPH,
            "bench",
            str(graph),
            *overrides,
            slow,
            "--sweep",
            "components.backend.replicas=1,2",
            "-c",
            "2",
            "-n",
            "400",
            "--output-len",
            "64",
            "--no-plots",
            "-o",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not served(state):
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.stderr else ""
            )
            time.sleep(0.1)
        time.sleep(1.0)  # the load is running
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not (state / "supervisor.pid").exists()
    records = json.loads((state / "processes.json").read_text())
    assert records and all(r["state"] in ("stopped", "exited") for r in records), records
    assert not (tmp_path / "out" / "sweep.json").exists()  # the sweep did not pretend to finish


def served(state: Path) -> bool:
    """The variant's processes are all ready (processes.json, as `up -d` waits on it)."""
    try:
        records = json.loads((state / "processes.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return len(records) >= 2 and all(r["state"] == "ready" for r in records)


def test_sweep_variant_that_cannot_start_fails_before_any_starts(tmp_path: Path, tiny_model: Path) -> None:
    """Each variant is preflighted before the first comes up: a missing model folder in the
    second one is exit 2 naming that variant, and nothing ran (no state, no result)."""
    graph, overrides = copy_graph(tmp_path, tiny_model)
    missing = tmp_path / "no-such-model"
    out = tmp_path / "sweep"
    done = run_cli(
        [
            "bench",
            str(graph),
            *overrides,
            "--sweep",
            f"models.tiny-model.path={tiny_model},{missing}",
            "-n",
            "4",
            *WORKLOAD,
            "-o",
            str(out),
        ],
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"(variant tiny-model.path={missing})" in done.stdout + done.stderr
    assert f"(variant tiny-model.path={tiny_model})" not in done.stdout + done.stderr
    assert not (tmp_path / ".dyngraph" / graph.stem / "processes.json").exists()
    assert not out.exists()
