"""Replicas over several nodes (a worker's `nodes`): how validation relates nodes, placement,
GPUs and parallel sizes (each refusal at its key's line), and the plan: one process per rank on
distinct hosts, the leader's rendezvous port on its host, and each rank's multi-node flags."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from dynamo_graph.backend.settings import FOLLOWING
from dynamo_graph.graph.build import Built, build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.plan import ProcessSpec
from dynamo_graph.graph.targets.dispatch import render
from tests.support.graph_problems import problems, valid
from tests.support.kube_schemas import dgd_errors, k8s_errors
from tests.support.processes import run_cli

HOSTS = """\
name: big
runtime: {discovery: etcd, request_plane: tcp, event_plane: nats}
infra: {etcd: {managed: true}, nats: {managed: true}}
hosts:
  local: {advertise_host: 10.0.0.1}
  a: {ssh: {address: 10.0.0.2}, gpus: 8}
  b: {ssh: {address: 10.0.0.3}, gpus: 8}
  c: {ssh: {address: 10.0.0.4}, gpus: 8}
models:
  m: {path: /models/big}
components:
  frontend: {kind: frontend}
  w:
    kind: worker
    model: m
"""


def _worker(**keys: str) -> str:
    return HOSTS + "".join(f"    {key}: {value}\n" for key, value in keys.items())


REFUSED = [
    (
        "engine-on-one-node",
        _worker(engine="mocker", nodes="2", placement="[a, b]"),
        "components.w.nodes",
        "engine mocker runs on one node; sglang, trtllm, vllm and python files span nodes",
        17,
    ),
    (
        "too-few-hosts",
        _worker(
            engine="sglang", nodes="3", placement="[a, b]", gpus="{per_replica: 3, tensor_parallel_size: 3}"
        ),
        "components.w.placement",
        "`nodes: 3` puts each replica's ranks on 3 distinct hosts: list at least 3 hosts, none twice",
        18,
    ),
    (
        "a-host-twice",
        _worker(engine="sglang", nodes="2", placement="[a, a]"),
        "components.w.placement",
        "none twice",
        18,
    ),
    (
        "gpus-split-unevenly",
        _worker(
            engine="vllm", nodes="2", placement="[a, b]", gpus="{per_replica: 3, tensor_parallel_size: 3}"
        ),
        "components.w.gpus.per_replica",
        "3 GPUs do not split evenly over 2 nodes",
        19,
    ),
    (
        "ranks-split-unevenly",
        _worker(engine="vllm", nodes="2", placement="[a, b]", gpus="{tensor_parallel_size: 3}"),
        "components.w.gpus.tensor_parallel_size",
        "tensor × pipeline × data parallel size 3 is not a multiple of `nodes` (2)",
        19,
    ),
    (
        "ranks-not-the-gpus",
        _worker(
            engine="sglang", nodes="2", placement="[a, b]", gpus="{per_replica: 8, tensor_parallel_size: 4}"
        ),
        "components.w.gpus.per_replica",
        "tensor × pipeline × data parallel size is 4, per_replica 8",
        19,
    ),
    (
        "more-gpus-per-node-than-the-host",
        _worker(
            engine="sglang", nodes="2", placement="[a, b]", gpus="{per_replica: 18, tensor_parallel_size: 18}"
        ),
        "components.w.gpus.per_replica",
        "asks for 9 GPU(s) on host 'a', which has 8",
        19,
    ),
]


@pytest.mark.parametrize(
    ("graph", "path", "fragment", "line"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_refused_with_the_key_and_its_line(graph: str, path: str, fragment: str, line: int) -> None:
    found = problems(graph)
    assert {p.path for p in found} == {path}, found
    assert fragment in found[0].message
    assert found[0].location is not None and found[0].location.line == line


def test_pipeline_parallel_in_engine_args_counts_with_tensor_parallel() -> None:
    graph = _worker(
        engine="vllm",
        nodes="2",
        placement="[a, b]",
        gpus="{per_replica: 8, tensor_parallel_size: 4}",
        engine_args="{pipeline_parallel_size: 2}",
    )
    assert valid(graph).components["w"].model_ranks() == 8


def _built(tmp_path: Path, text: str) -> Built:
    path = tmp_path / "graph.yaml"
    path.write_text(text)
    return build(path)


def _plan(tmp_path: Path, text: str) -> list[ProcessSpec]:
    return [p for p in _built(tmp_path, text).plan.processes if p.component == "w"]


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_each_replica_has_one_process_per_rank_on_distinct_hosts(tmp_path: Path) -> None:
    # DeepSeek-style: 2 nodes × 4 GPUs, TP 8; two replicas over three hosts, round-robin by rank.
    ranks = _plan(
        tmp_path,
        _worker(
            engine="sglang",
            nodes="2",
            replicas="2",
            placement="[a, b, c]",
            gpus="{per_replica: 8, tensor_parallel_size: 8}",
        ),
    )
    layout = [(p.name, p.host, p.replica, p.group, p.rank) for p in ranks]
    assert layout == [
        ("w-0", "a", 0, "w-0", 0),
        ("w-0.rank1", "b", 0, "w-0", 1),
        ("w-1", "c", 1, "w-1", 0),
        ("w-1.rank1", "a", 1, "w-1", 1),
    ]
    # GPUs split per node: each rank four of its host's, two ranks on host a take distinct ones.
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in ranks] == ["0,1,2,3", "0,1,2,3", "0,1,2,3", "4,5,6,7"]
    # The leader declares its rendezvous port (allocated on its host); every rank dials it there.
    for leader, follower, address in ((ranks[0], ranks[1], "10.0.0.2"), (ranks[2], ranks[3], "10.0.0.4")):
        port = f"{leader.name}.leader"
        assert leader.ports[port] == "auto" and port not in follower.ports
        for rank, proc in enumerate((leader, follower)):
            assert _flag(proc.argv, "--num-nodes") == "2"
            assert _flag(proc.argv, "--node-rank") == (str(rank) if rank else None)  # 0 is the default
            assert _flag(proc.argv, "--leader-addr") == f"{address}:{{port:{port}}}"
            assert _flag(proc.argv, "--tensor-parallel-size") == "8"
        # The leader is ready once it serves (every rank joined); a follower once it follows.
        assert (leader.readiness.target, follower.readiness.target) == ("serving model", FOLLOWING)
        assert leader.depends_on == follower.depends_on  # neither waits for the other


def test_an_autoscaled_multi_node_pool_keeps_each_replica_s_ranks_together(tmp_path: Path) -> None:
    """Standby replicas (what the planner may add) hold every rank of theirs; none is split."""
    plan = _built(
        tmp_path,
        _worker(
            engine="sglang",
            nodes="2",
            placement="[a, b, c]",
            gpus="{per_replica: 8, tensor_parallel_size: 8}",
            autoscale="{min_replicas: 1, max_replicas: 3, target: {ttft_p90_ms: 500}}",
        ),
    ).plan
    running = [(p.name, p.replica) for p in plan.processes if p.component == "w"]
    standby = [(p.name, p.replica) for p in plan.standby if p.component == "w"]
    assert running == [("w-0", 0), ("w-0.rank1", 0)]
    assert standby == [("w-1", 1), ("w-1.rank1", 1), ("w-2", 2), ("w-2.rank1", 2)]


def test_a_one_node_worker_is_unchanged(tmp_path: Path) -> None:
    (proc,) = _plan(tmp_path, _worker(engine="sglang", placement="[a]", gpus="{per_replica: 2}"))
    assert (proc.name, proc.group, proc.rank) == ("w-0", "", 0)
    assert "--num-nodes" not in proc.argv and "--leader-addr" not in proc.argv


def test_render_shell_shows_each_rank_and_is_valid_bash(tmp_path: Path) -> None:
    built = _built(
        tmp_path,
        _worker(
            engine="vllm", nodes="2", placement="[a, b]", gpus="{per_replica: 2, tensor_parallel_size: 2}"
        ),
    )
    script = render(built.graph, built.plan, "shell")
    assert "# w-0 on a" in script and "# w-0.rank1 on b" in script
    assert "PORT_W_0_LEADER=" in script and '"--node-rank", "1"' in script
    # vLLM's ranks advertise their host's address to each other (its default is loopback)
    assert [p.env["VLLM_HOST_IP"] for p in built.plan.processes if p.component == "w"] == [
        "10.0.0.2",
        "10.0.0.3",
    ]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_render_k8s_writes_a_strictly_valid_leader_worker_set_per_multi_node_worker(tmp_path: Path) -> None:
    built = _built(
        tmp_path,
        _worker(
            engine="sglang",
            nodes="2",
            replicas="3",
            placement="[a, b, c]",
            gpus="{per_replica: 8, tensor_parallel_size: 8}",
        ),
    )
    docs = list(yaml.safe_load_all(render(built.graph, built.plan, "k8s")))
    assert [e for d in docs for e in k8s_errors(d)] == []
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    assert lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    follower = group["workerTemplate"]["spec"]["containers"][0]
    for container in (leader, follower):
        assert _flag(container["command"], "--leader-addr") == "$(LWS_LEADER_ADDRESS):29500"
        assert _flag(container["command"], "--num-nodes") == "2"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"  # a pod is one node's share
    assert _flag(follower["command"], "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert "--node-rank" not in leader["command"] and "readinessProbe" not in follower
    assert {"name": "rendezvous", "containerPort": 29500} in leader["ports"]
    # A broken group is caught: the CRD's schema is strict.
    group["size"] = "two"
    assert k8s_errors(lws)


def test_render_dynamo_k8s_writes_the_node_count_and_gpus_per_node(tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    path.write_text(
        _worker(
            engine="sglang", nodes="2", placement="[a, b]", gpus="{per_replica: 8, tensor_parallel_size: 8}"
        )
    )
    built = build(path, engines="dynamo")
    dgd = yaml.safe_load(render(built.graph, built.plan, "dynamo-k8s"))
    assert dgd_errors(dgd) == []
    service = dgd["spec"]["services"]["w"]
    assert service["multinode"] == {"nodeCount": 2} and service["resources"]["limits"]["gpu"] == "4"


def test_on_slurm_each_rank_is_a_step_on_its_node_with_its_node_s_gres(tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    path.write_text(
        _worker(
            engine="sglang", nodes="2", placement="[a, b]", gpus="{per_replica: 8, tensor_parallel_size: 8}"
        )
        .replace("  a: {ssh: {address: 10.0.0.2}, gpus: 8}\n", "  a: {gpus: 4}\n")
        .replace("  b: {ssh: {address: 10.0.0.3}, gpus: 8}\n", "  b: {gpus: 4}\n")
        .replace("  c: {ssh: {address: 10.0.0.4}, gpus: 8}\n", "")
        + "slurm: {partition: gpu}\n"
    )
    built = build(path)
    script = render(built.graph, built.plan, "slurm")
    leader = script[script.index('cat > "$JOB/steps/w-0.cmd"') :].split("\nEOF\n", 1)[0]
    follower = script[script.index('cat > "$JOB/steps/w-0.rank1.cmd"') :].split("\nEOF\n", 1)[0]
    # The leader's rendezvous port is asked of the leader's node; both ranks dial it there.
    assert "--gres=gpu:4" in leader and "--gres=gpu:4" in follower
    assert leader.count('"$ADDR_A"\':\'"$PORT_W_0_LEADER"') == 1
    assert follower.count('"$ADDR_A"\':\'"$PORT_W_0_LEADER"') == 1 and "--node-rank 1" in follower
    assert "log 'following leader'" in follower
    # Each rank's step knows its group's others: one ending on its own takes them down.
    assert "run_step w-0 on-failure 5 1 30 w-0.rank1;" in script
    assert "run_step w-0.rank1 on-failure 5 1 30 w-0;" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


TRTLLM = _worker(
    engine="trtllm", nodes="2", placement="[a, b]", gpus="{per_replica: 8, tensor_parallel_size: 8}"
)


def test_a_trtllm_replica_over_nodes_is_one_mpi_launch_of_the_whole_world(tmp_path: Path) -> None:
    """TensorRT-LLM spans nodes as one MPI world (every task runs `trtllm-llmapi-launch`: task 0
    the command, the others its MPI workers), not as ranks meeting at a leader's address: one
    process per replica, the world's sizes on its command line, its tasks on each host."""
    (proc,) = _plan(tmp_path, TRTLLM)
    assert proc.argv[:8] == [
        "trtllm-llmapi-launch",
        "dyngraph",
        "run",
        "in=dyn://big.w.generate",
        "out=trtllm",
        "--model-path",
        "/models/big",
        "--model-name",
    ]
    assert _flag(proc.argv, "--tensor-parallel-size") == "8"
    assert not {"--num-nodes", "--node-rank", "--leader-addr"} & set(proc.argv)  # the adapter refuses them
    assert (proc.name, proc.host, proc.group, proc.mpi_hosts, proc.mpi_tasks) == (
        "w-0",
        "a",
        "",
        ["a", "b"],
        4,
    )
    assert not any(name.endswith(".leader") for name in proc.ports)  # no rendezvous port
    assert proc.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # its host's share


def test_on_slurm_a_trtllm_replica_is_one_srun_step_over_its_nodes_under_pmix(tmp_path: Path) -> None:
    """What cannot run here (no TensorRT-LLM, no GPU, no PMIx): the exact step of the sbatch script."""
    text = TRTLLM.replace("  a: {ssh: {address: 10.0.0.2}, gpus: 8}\n", "  a: {gpus: 4}\n")
    text = text.replace("  b: {ssh: {address: 10.0.0.3}, gpus: 8}\n", "  b: {gpus: 4}\n")
    text = text.replace("  c: {ssh: {address: 10.0.0.4}, gpus: 8}\n", "") + "slurm: {partition: gpu}\n"
    built = _built(tmp_path, text)
    script = render(built.graph, built.plan, "slurm")
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=4\n#SBATCH --gres=gpu:4\n" in script
    launch = script[script.index('cat > "$JOB/steps/w-0.cmd"') :].split("\nEOF\n", 1)[0].splitlines()
    assert launch[1:3] == [
        "log 'serving model' 120 \\",
        f'  --nodelist="$NODE_1","$NODE_2" --chdir={tmp_path} --nodes=2 --ntasks=8 --ntasks-per-node=4 '
        "--mpi=pmix --kill-on-bad-exit=1 --gres=gpu:4 \\",
    ]
    assert "CUDA_VISIBLE_DEVICES" not in launch[3]  # Slurm binds each task's GPUs
    assert launch[4] == (
        '  "$(dirname "$(command -v "$PY_1")")"/trtllm-llmapi-launch "$PY_1" -m dynamo_graph run '
        "in=dyn://big.w.generate out=trtllm --model-path /models/big --model-name m --tensor-parallel-size 8"
        ' --metrics-port "$PORT_W_0_METRICS" --metrics-host "$ADDR_A"'  # rank 0 runs the worker: its node
    )
    assert "run_step w-0 on-failure 5 1 30;" in script  # no peers: the step is the whole group
    assert "w-0.rank1" not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_a_trtllm_replica_over_nodes_is_shown_by_render_shell_and_refused_by_local_up_and_k8s(
    tmp_path: Path,
) -> None:
    built = _built(tmp_path, TRTLLM)
    script = render(built.graph, built.plan, "shell")
    assert (
        "# one MPI world of 8 tasks, 4 on each of a, b: run this under `mpirun -np 8 -H <a>:4,<b>:4`"
        in script
    )
    assert '"trtllm-llmapi-launch", "dyngraph", "run"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    done = run_cli(["up", "-d", str(tmp_path / "graph.yaml")], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{tmp_path / 'graph.yaml'}:17: components.w.nodes" in done.stderr, done.stderr
    assert "components.w.nodes: a TensorRT-LLM replica over nodes is one MPI job" in done.stderr
    with pytest.raises(
        GraphError, match=r"components.w.nodes: a TensorRT-LLM replica over nodes is one MPI job"
    ):
        render(built.graph, built.plan, "k8s")
    dgd = yaml.safe_load(render(built.graph, built.plan, "dynamo-k8s"))
    assert dgd_errors(dgd) == [] and dgd["spec"]["services"]["w"]["multinode"] == {"nodeCount": 2}
