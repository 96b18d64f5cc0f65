"""Graphs with remote hosts: the plan (hosts, planes at routable addresses, GPU spread, host env,
remote workdir), the validation of ssh settings, and `render -f shell`'s ssh commands."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.plan import RemoteHost
from dynamo_graph.graph.targets.dispatch import render
from dynamo_graph.graph.targets.local.ports import fill_plan

GRAPH = """
name: remote
runtime: {discovery: etcd, request_plane: tcp, event_plane: nats}
infra: {etcd: {managed: true}, nats: {managed: true}}
hosts:
  local: {advertise_host: 10.0.0.1}
  gpu1:
    ssh:
      address: 10.0.0.2
      user: ubuntu
      identity_file: /keys/id
      host_key: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey"
    venv: /opt/dg/.venv
    gpus: 4
  gpu2:
    ssh: {address: 10.0.0.3, port: 2200, known_hosts: /keys/known_hosts}
    workdir: /srv/dg
    gpus: 2
    env: {NCCL_DEBUG: INFO}
models:
  m: {path: /models/llama}
components:
  frontend: {kind: frontend}
  prefill:
    kind: worker
    model: m
    engine: mocker
    replicas: 3
    placement: [gpu1, gpu2]
    gpus: {per_replica: 1}
    role: prefill
    env: {HF_TOKEN: hush}
  decode:
    kind: worker
    model: m
    engine: mocker
    replicas: 2
    placement: [gpu1]
    gpus: {per_replica: 1}
    role: decode
"""


def _build(tmp_path: Path, text: str = GRAPH, *overrides: str):  # -> Built
    path = tmp_path / "graph.yaml"
    path.write_text(text)
    return build(path, list(overrides))


def test_plan_of_a_multi_host_graph(tmp_path: Path) -> None:
    plan = _build(tmp_path).plan
    assert plan.hosts == {
        "gpu1": RemoteHost(
            address="10.0.0.2",
            user="ubuntu",
            identity_file="/keys/id",
            host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey",
            python="/opt/dg/.venv/bin/python",
        ),
        "gpu2": RemoteHost(address="10.0.0.3", port=2200, known_hosts="/keys/known_hosts"),
    }
    procs = {p.name: p for p in plan.processes}
    # Replicas spread round-robin over placement; GPUs per host, never shared between components.
    assert [procs[f"prefill-{i}"].host for i in range(3)] == ["gpu1", "gpu2", "gpu1"]
    gpus = {n: (p.host, p.env.get("CUDA_VISIBLE_DEVICES")) for n, p in procs.items() if p.host != "local"}
    assert gpus == {
        "decode-0": ("gpu1", "0"),
        "decode-1": ("gpu1", "1"),
        "prefill-0": ("gpu1", "2"),
        "prefill-1": ("gpu2", "0"),
        "prefill-2": ("gpu1", "3"),
    }
    # Remote workers reach managed etcd / nats at the local advertise address and advertise their own;
    # across hosts `security.tls: auto` is TLS (test_tls_plan.py has the rest).
    worker = procs["prefill-1"]
    assert worker.env["ETCD_ENDPOINTS"] == "https://10.0.0.1:{port:etcd.client}"
    assert worker.env["NATS_SERVER"] == "tls://10.0.0.1:{port:nats.client}"
    assert worker.env["DYN_TCP_ADVERTISE_HOST"] == worker.env["DYN_TCP_HOST"] == "10.0.0.3"
    assert worker.env["NCCL_DEBUG"] == "INFO" and "NCCL_DEBUG" not in procs["prefill-0"].env
    assert (procs["etcd"].argv[procs["etcd"].argv.index("--listen-client-urls") + 1]).startswith(
        "https://10.0.0.1:"
    )
    assert procs["nats"].argv[:3] == ["nats-server", "-a", "10.0.0.1"]
    assert worker.workdir == "/srv/dg" and procs["prefill-0"].workdir == "~"


def test_auto_http_ports_are_placeholders_owned_by_the_frontend_s_host(tmp_path: Path) -> None:
    plan = _build(
        tmp_path,
        GRAPH,
        "+components.frontend.http={port: auto}",
        "+components.edge={kind: frontend, host: gpu2, http: {port: auto}}",
    ).plan
    procs = {p.name: p for p in plan.processes}
    edge = procs["edge-0"]
    assert (edge.host, edge.ports) == ("gpu2", {"edge-0.http": "auto"})
    assert edge.argv[edge.argv.index("--http-port") + 1] == "{port:edge-0.http}"
    assert edge.readiness.target == "http://127.0.0.1:{port:edge-0.http}/health"
    assert procs["frontend-0"].ports == {"frontend-0.http": "auto"}


def test_gpu_ids_named_by_one_component_are_skipped_by_the_others(tmp_path: Path) -> None:
    plan = _build(tmp_path, GRAPH, "+components.decode.gpus.gpu_ids=[0,2]").plan
    devices = {p.name: p.env.get("CUDA_VISIBLE_DEVICES") for p in plan.processes if p.host == "gpu1"}
    assert devices == {"decode-0": "0", "decode-1": "2", "prefill-0": "1", "prefill-2": "3"}


def test_oversubscribed_host_is_a_validation_error(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as err:
        _build(tmp_path, GRAPH, "components.decode.replicas=3")
    assert "components.decode.gpus.per_replica: asks for 3 GPU(s) on host 'gpu1' (5 with" in str(err.value)


def test_zmq_kv_events_across_hosts_bind_each_host_s_address(tmp_path: Path) -> None:
    """A kv router on one host subscribes to zmq publishers on the others: workers bind and announce
    their host's address (the request plane's DYN_TCP_HOST / DYN_TCP_ADVERTISE_HOST)."""
    plan = _build(tmp_path, GRAPH, "runtime.event_plane=zmq", "+components.frontend.router.mode=kv").plan
    env = {p.name: p.env for p in plan.processes}
    assert env["prefill-1"]["DYN_EVENT_PLANE"] == "zmq"
    assert (env["prefill-1"]["DYN_TCP_HOST"], env["prefill-0"]["DYN_TCP_HOST"]) == ("10.0.0.3", "10.0.0.2")


VLLM_PD = (
    "components.prefill.engine=vllm",
    "components.decode.engine=vllm",
    "+components.prefill.engine_args={kv_transfer_config: {kv_connector: NixlConnector}}",
    "+components.decode.engine_args={kv_transfer_config: {kv_connector: NixlConnector}}",
)


def _side(ports: dict[str, int | str]) -> dict[str, int | str]:
    """A process's ports but its /metrics (every worker has one: test_monitoring_render.py)."""
    return {name: port for name, port in ports.items() if not name.endswith(".metrics")}


def test_nixl_side_channel_ports_are_per_process_on_the_host_s_address(tmp_path: Path) -> None:
    """vLLM's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT / _HOST) gets a port of its own per
    process (`auto`: free on that host at `up`), bound on the host's address: two replicas on one
    host never share one. A port the graph sets pins it."""
    plan = _build(tmp_path, GRAPH, *VLLM_PD).plan
    procs = {p.name: p for p in plan.processes}
    workers = [n for n in procs if n.startswith(("prefill", "decode"))]
    assert {n: _side(procs[n].ports) for n in workers} == {n: {f"{n}.nixl": "auto"} for n in workers}
    assert {n: procs[n].env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for n in workers} == {
        n: f"{{port:{n}.nixl}}" for n in workers
    }
    assert {n: (procs[n].host, procs[n].env["VLLM_NIXL_SIDE_CHANNEL_HOST"]) for n in workers} == {
        "decode-0": ("gpu1", "10.0.0.2"),
        "decode-1": ("gpu1", "10.0.0.2"),
        "prefill-0": ("gpu1", "10.0.0.2"),
        "prefill-1": ("gpu2", "10.0.0.3"),
        "prefill-2": ("gpu1", "10.0.0.2"),
    }
    assert not [
        p for p in plan.processes if p.component == "frontend" and "VLLM_NIXL_SIDE_CHANNEL_PORT" in p.env
    ]

    # Filled: every process its own port (here all from this host's free ones).
    filled = fill_plan(plan, ports := {})
    side = {p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for p in filled.processes if p.name in workers}
    assert len(side) == 5 and {ports[f"{n}.nixl"] for n in workers} == {int(p) for p in side}

    # Pinned by the graph: no port allocated.
    plan = _build(tmp_path, GRAPH, *VLLM_PD, "+components.prefill.env.VLLM_NIXL_SIDE_CHANNEL_PORT=5600").plan
    pinned = next(p for p in plan.processes if p.name == "prefill-0")
    assert (_side(pinned.ports), pinned.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ({}, "5600")


def test_single_host_side_channels_bind_loopback_and_agg_workers_get_none(tmp_path: Path) -> None:
    text = """
name: one
models: {m: {path: /models/llama}}
components:
  frontend: {kind: frontend}
  prefill:
    kind: worker
    model: m
    engine: vllm
    role: prefill
    replicas: 2
    engine_args: {kv_transfer_config: {kv_connector: NixlConnector}}
  decode: {kind: worker, model: m, engine: vllm, role: decode, engine_args_file: /srv/decode.json}
  agg: {kind: worker, model: m, engine: vllm}
"""
    plan = _build(tmp_path, text).plan
    side = [(p.name, p.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST"), list(_side(p.ports))) for p in plan.processes]
    assert side == [
        ("agg-0", None, []),
        ("decode-0", "127.0.0.1", ["decode-0.nixl"]),
        ("frontend-0", None, ["frontend-0.http"]),
        ("prefill-0", "127.0.0.1", ["prefill-0.nixl"]),
        ("prefill-1", "127.0.0.1", ["prefill-1.nixl"]),
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+hosts.gpu2.ssh.host_key='ssh-ed25519 AAAA'", "give either `host_key` or `known_hosts`, not both"),
        ("hosts.gpu1.ssh.host_key=AAAA", "expected `TYPE BASE64`"),
    ],
)
def test_host_key_settings_are_checked(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(GraphError) as err:
        _build(tmp_path, GRAPH, override)
    assert message in str(err.value)


def test_shell_render_shows_the_ssh_commands_of_up(tmp_path: Path) -> None:
    built = _build(tmp_path)
    text = render(built.graph, built.plan, "shell")
    assert text == render(built.graph, built.plan, "shell")
    prefill1 = next(line for line in text.splitlines() if "prefill-1" in line and "ssh" in line)
    assert prefill1.endswith(
        "| ssh -p 2200 -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile=/keys/known_hosts "
        "10.0.0.3 'python3 -m dynamo_graph.graph.targets.local.remote.agent run' &"
    )
    assert "echo '10.0.0.2 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey' > \"$KNOWN_HOSTS_GPU1\"" in text
    agent = "python -m dynamo_graph.graph.targets.local.remote.agent run"
    assert f"ubuntu@10.0.0.2 '/opt/dg/.venv/bin/{agent}' &" in text
    assert "hush" not in text and '"HF_TOKEN": "***"' in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_shell_render_asks_a_remote_host_for_its_auto_ports(tmp_path: Path) -> None:
    built = _build(tmp_path, GRAPH, "+components.edge={kind: frontend, host: gpu2, http: {port: auto}}")
    lines = render(built.graph, built.plan, "shell").splitlines()
    assert (
        "PORT_EDGE_0_HTTP=$(ssh -p 2200 -o BatchMode=yes -o StrictHostKeyChecking=yes -o "
        "UserKnownHostsFile=/keys/known_hosts 10.0.0.3 "
        "'python3 -m dynamo_graph.graph.targets.local.remote.agent ports 1' | tr -d '[]')" in lines
    )
    assert "PORT_NATS_CLIENT=$(free_port)" in lines


SGLANG_PD = (
    "components.prefill.engine=sglang",
    "components.decode.engine=sglang",
    "+components.prefill.engine_args={disaggregation_transfer_backend: nixl}",
    "+components.decode.engine_args={disaggregation_transfer_backend: nixl}",
)


def test_each_sglang_prefill_worker_gets_its_bootstrap_port_on_its_host_s_address(tmp_path: Path) -> None:
    """SGLang's prefill bootstrap server (`--disaggregation-bootstrap-port`, SGLANG_HOST_IP as the
    address it advertises in its card): a port per prefill process, free on its host at `up`;
    decode workers open none. A port in engine_args pins it."""
    plan = _build(tmp_path, GRAPH, *SGLANG_PD).plan
    procs = {p.name: p for p in plan.processes}
    prefills = [n for n in procs if n.startswith("prefill")]
    assert {n: _side(procs[n].ports) for n in prefills} == {n: {f"{n}.bootstrap": "auto"} for n in prefills}
    assert {n: procs[n].argv[-2:] for n in prefills} == {
        n: ["--disaggregation-bootstrap-port", f"{{port:{n}.bootstrap}}"] for n in prefills
    }
    assert {n: procs[n].env["SGLANG_HOST_IP"] for n in prefills} == {
        "prefill-0": "10.0.0.2",
        "prefill-1": "10.0.0.3",
        "prefill-2": "10.0.0.2",
    }
    decodes = [p for p in plan.processes if p.component == "decode"]
    assert all(not _side(p.ports) and "--disaggregation-bootstrap-port" not in p.argv for p in decodes)
    filled = fill_plan(plan, ports := {})
    bound = {p.argv[-1] for p in filled.processes if p.name in prefills}
    assert len(bound) == 3 and {int(b) for b in bound} == {ports[f"{n}.bootstrap"] for n in prefills}

    plan = _build(
        tmp_path,
        GRAPH,
        *SGLANG_PD[:3],
        "+components.decode.engine_args={disaggregation_transfer_backend: nixl}",
        "+components.prefill.engine_args.disaggregation_bootstrap_port=30001",
    ).plan
    pinned = next(p for p in plan.processes if p.name == "prefill-0")
    assert not _side(pinned.ports) and "--disaggregation-bootstrap-port" not in pinned.argv
