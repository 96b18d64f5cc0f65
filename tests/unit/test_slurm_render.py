"""`render -f slurm`: the sbatch script of a graph, and the `slurm:` section's validation.

The script is run for real in tests/system/test_slurm.py; here: its text is deterministic
(snapshot), sized from replicas, GPUs and placement, holds no secret, passes `bash -n`, and a
graph that cannot run on Slurm is refused with file:line.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.dispatch import render
from dynamo_graph.graph.targets.local.changes import plan_changes
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.slurm.job import SlurmState, records, running_plan
from dynamo_graph.graph.targets.slurm.rollout import needs_new_job
from dynamo_graph.graph.targets.slurm.script import fill_plan, launches, secret_env, slurm_plan
from tests.support.processes import run_cli

ROOT = Path(__file__).resolve().parents[2]
GPU_GRAPH = ROOT / "tests" / "fixtures" / "slurm" / "gpu-cluster.yaml"
SNAPSHOT = ROOT / "tests" / "fixtures" / "snapshots" / "slurm-gpu-cluster.sh"


def _script(path: Path, overrides: list[str] = ()) -> str:
    built = build(path, overrides)
    return render(built.graph, built.plan, "slurm")


def _write(tmp_path: Path, graph: dict[str, Any]) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(graph, sort_keys=False))
    return path


def _problems(path: Path) -> str:
    """What `dyngraph validate` prints for the graph (it must have problems)."""
    with pytest.raises(GraphError) as caught:
        build(path)
    return "\n".join(str(p) for p in caught.value.problems)


def _graph(**changes: Any) -> dict[str, Any]:
    graph: dict[str, Any] = {
        "name": "g",
        "slurm": {},
        "models": {"m": {"path": "org/model"}},
        "components": {
            "frontend": {"kind": "frontend"},
            "backend": {"kind": "worker", "model": "m", "engine": "mocker", "replicas": 2},
        },
    }
    graph.update(changes)
    return graph


def test_snapshot() -> None:
    """Output is deterministic and reviewed: UPDATE_SNAPSHOTS=1 rewrites the file."""
    text = _script(GPU_GRAPH).replace(str(ROOT), "<repo>")
    assert text == _script(GPU_GRAPH).replace(str(ROOT), "<repo>")
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text()


SHIPPED = sorted(p for p in (ROOT / "graphs").rglob("*.yaml") if ".dyngraph" not in p.parts)


@pytest.mark.parametrize("path", [GPU_GRAPH, *SHIPPED], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_graph_renders_the_same_valid_bash_script_twice(tmp_path: Path, path: Path) -> None:
    overrides = [] if path == GPU_GRAPH else ["+slurm={}"]
    script = tmp_path / "job.sbatch"
    script.write_text(_script(path, overrides))
    assert script.read_text() == _script(path, overrides)
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_allocation_is_sized_from_replicas_gpus_and_placement() -> None:
    text = _script(GPU_GRAPH)
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    # local: etcd, nats, frontend; gpu: 2 decode replicas with 2 GPUs each
    assert header[:5] == [
        "#SBATCH --job-name=gpu-cluster",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=3",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --partition=gpu",
    ]
    assert "#SBATCH --constraint=h100" in header and "#SBATCH --exclusive" in header
    decode = text[text.index("# decode-0") : text.index("# decode-1")]
    assert '--nodelist="$NODE_1"' in decode and "--gres=gpu:2" in decode
    assert "CUDA_VISIBLE_DEVICES" not in text  # Slurm binds each step's GPUs
    frontend = text[text.index("# frontend-0") :]
    assert '--nodelist="$NODE_0"' in frontend and "--gres=none" in frontend
    assert "{ run_step etcd " in text and "{ run_step nats " in text  # managed infra: steps on node 0
    assert text.index("# etcd on local (node 0)") < text.index("# decode-0")
    # workers advertise their node's address; managed infra binds the first node's
    assert 'DYN_TCP_ADVERTISE_HOST="$ADDR_GPU"' in decode
    assert "ETCD_ENDPOINTS='https://'\"$ADDR_LOCAL\"" in decode  # nodes apart: TLS (security.tls auto)


def test_no_secret_value_in_the_script() -> None:
    built = build(GPU_GRAPH)
    text = render(built.graph, built.plan, "slurm")
    assert "hf_not_in_the_script" not in text
    assert '{ export HF_TOKEN="$DYNGRAPH_SECRET_0"; await_ready decode-0 ' in text
    assert secret_env(slurm_plan(built.graph, built.plan)) == {"DYNGRAPH_SECRET_0": "hf_not_in_the_script"}


def test_one_node_by_default(tmp_path: Path) -> None:
    text = _script(_write(tmp_path, _graph()))
    assert "#SBATCH --nodes=1" in text and "#SBATCH --ntasks-per-node=3" in text
    assert "--gres" not in text  # no GPUs asked for: no GRES anywhere


def test_an_autoscaled_pool_holds_its_max_replicas_as_standby_steps_and_a_planner(tmp_path: Path) -> None:
    """The allocation fits max_replicas (up to the node's GPUs); the replicas beyond `replicas`
    wait on their `.off`, written before their launch; the planner runs beside the steps."""
    scaled = {"min_replicas": 1, "max_replicas": 6, "target": {"ttft_p90_ms": 500}}
    worker = {"kind": "worker", "model": "m", "engine": "mocker", "replicas": 1, "autoscale": scaled}
    graph = _graph(
        hosts={"gpu": {"gpus": 4}},
        runtime={"discovery": "etcd"},
        infra={"etcd": {"managed": True}},
        components={
            "frontend": {"kind": "frontend"},
            "backend": {**worker, "placement": ["gpu"], "gpus": {"per_replica": 2}},
        },
    )
    text = _script(_write(tmp_path, graph))
    # node 0: etcd, the frontend; node 1 (4 GPUs): backend-0 and backend-1, the most that fit
    assert (
        "#SBATCH --nodes=2" in text
        and "#SBATCH --ntasks-per-node=2" in text
        and "#SBATCH --gres=gpu:4" in text
    )
    assert "# backend-0 on gpu (node 1)\ncat >" in text
    standby = text[text.index("# backend-1 on gpu (node 1), standby") :]
    assert standby.index('touch "$JOB/steps/backend-1.off"') < standby.index(
        'cat > "$JOB/steps/backend-1.cmd"'
    )
    assert "backend-2" not in text
    assert '"$PY" -m dynamo_graph.graph.targets.slurm.autoscale "$STATE" "$SLURM_JOB_ID"' in text
    assert "slurm.autoscale" not in _script(_write(tmp_path, _graph()))  # no autoscaled pool, no planner


def test_running_plan_follows_the_planner(tmp_path: Path) -> None:
    """A standby replica counts once its launch is written and its `.off` gone; a retired one
    (`.off` again) does not, and its next run's records start afresh."""
    scaled = {"min_replicas": 1, "max_replicas": 3, "target": {"ttft_p90_ms": 500}}
    worker = {"kind": "worker", "model": "m", "engine": "mocker", "replicas": 1, "autoscale": scaled}
    built = build(_write(tmp_path, _graph(components={"frontend": {"kind": "frontend"}, "backend": worker})))
    plan = slurm_plan(built.graph, built.plan)
    state = SlurmState(StateDir(plan.state_dir))
    steps = state.job_dir / "steps"
    steps.mkdir(parents=True)
    for name in ("backend-0", "backend-1", "backend-2", "frontend-0"):
        (steps / f"{name}.cmd").write_text("launch\n")
    (steps / "backend-2.off").touch()

    def on() -> list[str]:
        return [p.name for p in running_plan(state, plan).processes]

    assert on() == ["backend-0", "frontend-0", "backend-1"]  # backend-1's `.off` removed: started
    (steps / "backend-0.off").touch()
    assert on() == ["frontend-0", "backend-1"]
    assert [p.name for p in running_plan(state, plan).standby] == ["backend-0", "backend-2"]
    (steps / "backend-1").write_text(
        "off 99\nstart 100 1 a\nready 101\nexit 143 150\noff 150\nstart 160 1 a\n"
    )
    got = records(state, running_plan(state, plan), job_active=True)["backend-1"]
    assert (got.state, got.restarts, got.message) == ("starting", 0, "")


def test_graph_without_a_slurm_section_is_refused(tmp_path: Path) -> None:
    graph = _graph()
    del graph["slurm"]
    path = _write(tmp_path, graph)
    with pytest.raises(GraphError, match="needs a `slurm:` section"):
        _script(path)
    assert "#SBATCH --partition=debug" in _script(path, ["+slurm.partition=debug"])


@pytest.mark.parametrize(
    ("slurm", "where", "message"),
    [
        ({"time": "tomorrow"}, "slurm.time", "'tomorrow' is not a Slurm time limit"),
        ({"gres": "gpu a100"}, "slurm.gres", "is not a GRES name"),
        ({"sbatch": ["--nodes=4"]}, "slurm.sbatch.0", "--nodes is set by dyngraph"),
        ({"sbatch": ["constraint=a100"]}, "slurm.sbatch.0", "is not an sbatch option"),
        ({"partitoin": "x"}, "slurm.partitoin", "did you mean 'partition'"),
    ],
)
def test_slurm_section_errors_name_file_line_and_key(
    tmp_path: Path, slurm: dict[str, Any], where: str, message: str
) -> None:
    path = _write(tmp_path, _graph(slurm=slurm))
    problems = _problems(path)
    assert f"{path}:3: {where}: " in problems or f"{path}:4: {where}: " in problems, problems
    assert message in problems


def test_gpu_ids_are_refused_on_slurm(tmp_path: Path) -> None:
    graph = _graph(hosts={"local": {"gpus": 4}})
    graph["components"]["backend"]["gpus"] = {"per_replica": 1, "gpu_ids": [0, 1]}
    problems = _problems(_write(tmp_path, graph))
    assert "components.backend.gpus.gpu_ids: on Slurm the scheduler picks each step's GPUs" in problems


def test_hosts_are_nodes_without_ssh_only_with_a_slurm_section(tmp_path: Path) -> None:
    graph = _graph(
        hosts={"n2": {}},
        runtime={"discovery": "etcd"},
        infra={"etcd": {"managed": True}},
    )
    graph["components"]["backend"]["placement"] = ["n2"]
    path = _write(tmp_path, graph)
    build(path)  # valid: no advertise_host needed either
    del graph["slurm"]
    assert "hosts.n2.ssh: a host other than `local` needs `ssh" in _problems(_write(tmp_path, graph))


def test_local_up_refuses_slurm_nodes_with_file_line(tmp_path: Path) -> None:
    graph = _graph(hosts={"n2": {}}, runtime={"discovery": "etcd"}, infra={"etcd": {"managed": True}})
    graph["components"]["backend"]["placement"] = ["n2"]
    path = _write(tmp_path, graph)
    done = run_cli(["up", "-d", str(path)], timeout=60)
    assert done.returncode == 2
    assert f"{path}:" in done.stderr and "hosts.n2.ssh: a Slurm node (no `ssh`)" in done.stderr
    assert not (tmp_path / ".dyngraph" / "graph" / "supervisor.pid").exists()


def test_frontend_off_the_first_node_must_bind_a_reachable_address(tmp_path: Path) -> None:
    graph = _graph(hosts={"n2": {}})
    graph["components"]["frontend"]["host"] = "n2"
    problems = _problems(_write(tmp_path, graph))
    assert "components.frontend.http.host: host 'n2' is not the job's first node" in problems


def _job_steps(tmp_path: Path) -> tuple[Plan, SlurmState, Path]:
    """The plan of `_graph()` compiled for Slurm, its job's state, and the (empty) dir where the
    job script writes each process's events."""
    built = build(_write(tmp_path, _graph()))
    plan = slurm_plan(built.graph, built.plan)
    state = SlurmState(StateDir(plan.state_dir))
    steps = state.job_dir / "steps"
    steps.mkdir(parents=True)
    return plan, state, steps


def test_records_follow_the_step_events(tmp_path: Path) -> None:
    """What `status` shows, from the events the script writes (script.py's docstring)."""
    plan, state, steps = _job_steps(tmp_path)
    (steps / "frontend-0").write_text("start 100 1\nready 101\n")
    (steps / "backend-0").write_text("start 100 1\nready 101\nexit 137 150\nstart 151 2\nready 152\n")
    (steps / "backend-1").write_text("start 100 1\nexit 1 101\ncrashloop 102\n")
    got = records(state, plan, job_active=True)
    assert got["frontend-0"].state == "ready"
    assert (got["backend-0"].state, got["backend-0"].restarts) == ("ready", 1)
    assert got["backend-0"].message == "restarted after exit 137 (SIGKILL)"
    assert got["backend-1"].state == "failed"
    assert records(state, plan, job_active=False)["frontend-0"].state == "stopped"


def test_records_tell_a_rank_taken_down_with_its_group(tmp_path: Path) -> None:
    """A rank whose peer ended gets `down` before its own exit (script.py's take_down); status
    says so while it waits to start again, and after."""
    plan, state, steps = _job_steps(tmp_path)
    (steps / "backend-0").write_text("start 100 1 a\nready 101\ndown 150 backend-1\nexit 0 151\n")
    (steps / "backend-1").write_text("start 100 1 a\nready 101\nexit 137 150\nstart 152 2 a\n")
    got = records(state, plan, job_active=True)
    assert (got["backend-0"].state, got["backend-0"].message) == (
        "restarting",
        "step ended with exit 0, taken down with its group (backend-1 ended)",
    )
    assert got["backend-1"].message == "restarted after exit 137 (SIGKILL)"
    with (steps / "backend-0").open("a") as events:
        events.write("start 153 2 a\nready 160\n")
    got = records(state, plan, job_active=True)["backend-0"]
    assert (got.state, got.restarts) == ("ready", 1)
    assert got.message == "restarted with its group after backend-1 ended"


def test_a_replaced_run_starts_its_records_afresh(tmp_path: Path) -> None:
    """A rollout's replacement (`replace` after the old run's exit) is no restart, nor a crash."""
    plan, state, steps = _job_steps(tmp_path)
    (steps / "backend-0").write_text(
        "start 100 1 a\nready 101\nexit 143 150\nreplace 150\nstart 150 1 b\nready 152\n"
    )
    got = records(state, plan, job_active=True)["backend-0"]
    assert (got.state, got.restarts, got.message, got.started_at) == ("ready", 0, "", 150.0)


def test_a_change_needing_another_allocation_names_each_reason(tmp_path: Path) -> None:
    """GPUs cannot be exercised here (no GPU): the refusal is checked on the plans and scripts."""
    graph = _graph(hosts={"local": {"gpus": 8}})
    graph["components"]["backend"]["gpus"] = {"per_replica": 1}
    old = build(_write(tmp_path, graph))
    graph["components"]["backend"]["gpus"] = {"per_replica": 2}
    graph["components"]["backend"]["env"] = {"HF_TOKEN": "another"}
    new = build(_write(tmp_path, graph))
    old_plan, new_plan = (slurm_plan(b.graph, b.plan) for b in (old, new))
    changes = plan_changes({p.name: p for p in old_plan.processes}, old_plan.files, new_plan, set())
    reasons = needs_new_job(
        old_plan,
        new_plan,
        launches(old.graph, old_plan),
        launches(new.graph, new_plan),
        render(old.graph, old.plan, "slurm"),
        render(new.graph, new.plan, "slurm"),
        changes,
    )
    assert reasons[0] == "the job's allocation changes: --gres gpu:2 -> gpu:4", reasons
    assert reasons[1] == (
        "backend-0: its step's GPUs change (--gres=gpu:1 -> --gres=gpu:2); a secret env value changes "
        "(the job has them from its environment at submission)"
    ), reasons
    assert len(reasons) == 3 and reasons[2].startswith("backend-1: "), reasons
    same = needs_new_job(
        old_plan,
        old_plan,
        launches(old.graph, old_plan),
        launches(old.graph, old_plan),
        render(old.graph, old.plan, "slurm"),
        render(old.graph, old.plan, "slurm"),
        plan_changes({p.name: p for p in old_plan.processes}, old_plan.files, old_plan, set()),
    )
    assert same == []


def test_fill_plan_puts_the_job_addresses_and_ports_in(tmp_path: Path) -> None:
    graph = _graph(runtime={"discovery": "etcd"}, infra={"etcd": {"managed": True}}, hosts={"n2": {}})
    graph["components"]["frontend"]["http"] = {"port": "auto"}
    graph["components"]["backend"]["placement"] = ["n2"]
    built = build(_write(tmp_path, graph))
    plan = slurm_plan(built.graph, built.plan)
    resolved = {"ADDR_LOCAL": "10.0.0.7", "PORT_ETCD_CLIENT": "2379", "PORT_FRONTEND_0_HTTP": "8123"}
    filled = fill_plan(plan, resolved)
    frontend = next(p for p in filled.processes if p.name == "frontend-0")
    assert frontend.env["ETCD_ENDPOINTS"] == "https://10.0.0.7:2379"
    assert frontend.argv[frontend.argv.index("--http-port") + 1] == "8123"
    assert frontend.ports == {"frontend-0.http": 8123}
    backend = next(p for p in filled.processes if p.name == "backend-0")
    assert backend.env["DYN_TCP_ADVERTISE_HOST"] == "{node:n2}"  # not resolved: left as it was
