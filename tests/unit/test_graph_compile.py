"""Graph -> Plan -> rendered text: deterministic, and what `dyngraph up` would launch."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dynamo_graph.frontend.settings import GROUP_ENV
from dynamo_graph.graph.build import build
from dynamo_graph.graph.targets.dispatch import ENGINES_OF_FORMAT, FORMATS, render

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(
    p for p in (ROOT / "graphs").rglob("*.yaml") if "templates" not in p.parts and ".dyngraph" not in p.parts
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "graph.yaml"
    path.write_text(text)
    return path


BASE = """
name: demo
models:
  tiny:
    path: ./model
components:
  frontend:
    kind: frontend
    http: {port: 18555}
  backend:
    kind: worker
    model: tiny
    engine: echo_core
"""


@pytest.mark.parametrize("graph_file", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_graph_renders_identically_twice(graph_file: Path) -> None:
    first, second = build(graph_file), build(graph_file)
    # The DGD of a graph on Dynamo's engines: tests/unit/test_dynamo_k8s.py renders each; the Slurm
    # script needs a `slurm:` section: tests/unit/test_slurm_render.py adds one to each.
    for fmt in (f for f in FORMATS if f not in ENGINES_OF_FORMAT and f != "slurm"):
        assert render(first.graph, first.plan, fmt) == render(second.graph, second.plan, fmt), fmt


def test_plan_of_a_small_graph(tmp_path: Path) -> None:
    built = build(_write(tmp_path, BASE))
    names = [p.name for p in built.plan.processes]
    assert names == ["backend-0", "frontend-0"]
    worker, frontend = built.plan.processes
    assert worker.argv[:4] == ["dyngraph", "run", "in=dyn://demo.backend.generate", "out=echo_core"]
    assert worker.argv[worker.argv.index("--model-path") + 1] == str((tmp_path / "model").resolve())
    assert worker.env["DYN_DISCOVERY_BACKEND"] == "file"
    assert worker.env["DYN_FILE_KV"] == str(tmp_path.resolve() / ".dyngraph" / "graph" / "discovery")
    assert worker.env["PYTHONHASHSEED"] == "0"
    assert worker.readiness.kind == "log"
    assert frontend.argv[:4] == ["dyngraph", "run", "in=http", "out=auto"]
    assert frontend.readiness.target == "http://127.0.0.1:18555/health"  # ready = a model is listed
    assert frontend.env["DYN_FILE_KV"] == worker.env["DYN_FILE_KV"]


def test_overrides_scale_replicas_and_add_env(tmp_path: Path) -> None:
    built = build(
        _write(tmp_path, BASE), ["+components.backend.replicas=3", "+components.backend.env.FOO=bar"]
    )
    workers = [p for p in built.plan.processes if p.component == "backend"]
    assert [p.name for p in workers] == ["backend-0", "backend-1", "backend-2"]
    assert all(p.env["FOO"] == "bar" for p in workers)


def test_frontend_replicas_share_one_port_and_a_metrics_group(tmp_path: Path) -> None:
    text = BASE.replace("http: {port: 18555}", "http: {port: auto}")
    one = [p for p in build(_write(tmp_path, text)).plan.processes if p.component == "frontend"]
    assert [p.name for p in one] == ["frontend-0"] and GROUP_ENV not in one[0].env  # as before replicas
    built = build(_write(tmp_path, text), ["+components.frontend.replicas=3"])
    frontends = [p for p in built.plan.processes if p.component == "frontend"]
    assert [(p.name, p.replica) for p in frontends] == [
        ("frontend-0", 0),
        ("frontend-1", 1),
        ("frontend-2", 2),
    ]
    assert {tuple(p.argv) for p in frontends} == {tuple(one[0].argv)}  # one placeholder: one port
    assert all(p.ports == {"frontend-0.http": "auto"} and p.shares_ports and p.rolls for p in frontends)
    assert {p.env[GROUP_ENV] for p in frontends} == {"demo.frontend"}


def test_depends_on_and_managed_infra(tmp_path: Path) -> None:
    text = BASE.replace(
        "name: demo",
        """name: demo
runtime: {discovery: etcd, request_plane: nats, event_plane: nats}
infra:
  etcd: {managed: true}
  nats: {managed: true}""",
    ).replace("kind: frontend", "kind: frontend\n    depends_on: [backend]")
    plan = build(_write(tmp_path, text)).plan
    names = [p.name for p in plan.processes]
    assert names[:2] == ["etcd", "nats"]
    frontend = next(p for p in plan.processes if p.component == "frontend")
    assert frontend.depends_on == ["etcd", "nats", "backend-0"]
    assert frontend.env["ETCD_ENDPOINTS"] == "http://127.0.0.1:{port:etcd.client}"
    assert frontend.env["NATS_SERVER"] == "nats://127.0.0.1:{port:nats.client}"
    assert "DYN_FILE_KV" not in frontend.env


def test_inline_engine_args_become_a_file_and_gpus_a_device_list(tmp_path: Path) -> None:
    text = BASE.replace("name: demo", "name: demo\nhosts:\n  local: {gpus: 4}").replace(
        "engine: echo_core",
        "engine: echo_core\n    replicas: 2\n    engine_args: {block_size: 32}\n    gpus: {per_replica: 2}",
    )
    plan = build(_write(tmp_path, text)).plan
    workers = [p for p in plan.processes if p.component == "backend"]
    path = workers[0].argv[workers[0].argv.index("--extra-engine-args") + 1]
    assert plan.files[path] == '{\n  "block_size": 32\n}\n'
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "2,3"]


def test_shell_render_is_valid_bash_and_mermaid_draws_the_route(tmp_path: Path) -> None:
    text = BASE.replace(
        "name: demo", "name: demo\ninfra:\n  nats: {managed: true}\nruntime: {request_plane: nats}"
    )
    built = build(_write(tmp_path, text))
    script = render(built.graph, built.plan, "shell")
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0
    assert "PORT_NATS_CLIENT=$(free_port)" in script
    assert "dyngraph run in=dyn://demo.backend.generate out=echo_core" in script
    mermaid = render(built.graph, built.plan, "mermaid")
    assert mermaid.startswith("flowchart LR")
    assert "frontend -->|round-robin| ep_dyn___demo_backend_generate" in mermaid


def test_cli_validate_and_render(tmp_path: Path) -> None:
    from tests.support.processes import run_cli

    good = _write(tmp_path, BASE)
    result = run_cli(["validate", str(good)])
    assert result.returncode == 0, result.stderr
    result = run_cli(["render", str(good), "--format", "json"])
    assert result.returncode == 0 and '"processes"' in result.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("engine: echo_core", "engine: echo_core\n    replicaz: 2"))
    result = run_cli(["validate", str(bad)])
    assert result.returncode == 2
    assert f"{bad}:" in result.stderr and "components.backend.replicaz" in result.stderr
    assert "replicas" in result.stderr  # did-you-mean


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_fault_tolerance_settings_become_flags_and_env(tmp_path: Path) -> None:
    text = (
        BASE.replace(
            "    http: {port: 18555}\n",
            "    http: {port: 18555}\n    migration_limit: 2\n    api_key_env: [DEMO_KEY]\n"
            "    limits: {request_timeout_s: 30, health_check_interval_s: 2, health_check_timeout_s: 1}\n",
        )
        + "    max_inflight: 16\n    shutdown_grace_s: 8\n"
    )
    worker, frontend = build(_write(tmp_path, text)).plan.processes
    assert _flag(frontend.argv, "--migration-limit") == "2"
    assert _flag(frontend.argv, "--request-timeout-s") == "30"
    assert _flag(frontend.argv, "--health-check-interval-s") == "2"
    assert _flag(frontend.argv, "--health-check-timeout-s") == "1"
    assert "--max-concurrent-requests" not in frontend.argv  # the default goes without saying
    assert frontend.env["DYN_API_KEY_ENV"] == "DEMO_KEY"  # the variable's name, never a key
    assert _flag(worker.argv, "--max-inflight") == "16"
    assert worker.env["DYN_SHUTDOWN_GRACE_S"] == "5"  # drained before the supervisor's SIGKILL at 8 s
    # Left unset, the frontend lets the workers' cards decide the migration limit.
    _, plain = build(_write(tmp_path, BASE)).plan.processes
    assert "--migration-limit" not in plain.argv and "--health-check-interval-s" not in plain.argv


def test_a_keys_file_becomes_its_path_relative_to_the_graph(tmp_path: Path) -> None:
    text = BASE.replace(
        "    http: {port: 18555}\n", "    http: {port: 18555}\n    auth: {keys_file: conf/keys.yaml}\n"
    )
    _, frontend = build(_write(tmp_path, text)).plan.processes
    assert _flag(frontend.argv, "--api-keys-file") == str(tmp_path / "conf" / "keys.yaml")
    _, plain = build(_write(tmp_path, BASE)).plan.processes
    assert "--api-keys-file" not in plain.argv


def test_roles_and_the_frontend_disagg_block_become_flags(tmp_path: Path) -> None:
    text = """
name: pd
models:
  tiny: {path: ./model}
components:
  frontend:
    kind: frontend
    router: {mode: kv}
    disagg: {conditional: true, max_local_prefill_length: 100, enforce: false}
  prefill: {kind: worker, model: tiny, engine: mocker, role: prefill}
  decode: {kind: worker, model: tiny, engine: mocker, role: decode, replicas: 2}
"""
    built = build(_write(tmp_path, text))
    procs = {p.name: p for p in built.plan.processes}
    assert _flag(procs["prefill-0"].argv, "--disaggregation-mode") == "prefill"
    assert _flag(procs["decode-1"].argv, "--disaggregation-mode") == "decode"
    frontend = procs["frontend-0"].argv
    assert "--router-conditional-disagg" in frontend and "--enforce-disagg" not in frontend
    assert _flag(frontend, "--max-local-prefill-length") == "100"
    mermaid = render(built.graph, built.plan, "mermaid")
    assert "prefill -.->|KV cache| decode" in mermaid
    assert "frontend -->|1 prefill, kv| ep_dyn___pd_prefill_generate" in mermaid
