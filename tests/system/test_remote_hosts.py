"""`dyngraph up` on remote hosts: two network namespaces, each with a real sshd (tests/support/ssh_hosts.py),
the frontend and managed etcd + nats-server here, workers there over ssh.

The namespaces share the pid space with the test, so a remote pid can be signalled and looked
up from here; what counts as "on a host" is `ip netns pids` of its namespace.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from dynamo_graph.graph.build import build
from dynamo_graph.graph.plan import Probe, ProcessSpec, RemoteHost, RestartPolicy
from dynamo_graph.graph.targets.local.ports import fill_plan
from dynamo_graph.graph.targets.local.remote.agent import REATTACH_S
from dynamo_graph.graph.targets.local.remote.ssh import RemoteProcess
from dynamo_graph.graph.targets.local.remote.ssh import SshHosts as SshHosts_
from tests.support.listeners import listening, plain_answer, tls_without_certificate
from tests.support.processes import DYNGRAPH, free_port, pid_alive, port_refuses, run_cli
from tests.support.prometheus import scrape
from tests.support.rolling_load import StreamingLoad
from tests.support.routing import opening_messages, served_by
from tests.support.ssh_hosts import SshHost, SshHosts, missing_requirements
from tests.support.waiting import wait_for

VENV = Path(__file__).resolve().parents[2] / ".venv"
SECRET = "s3cret-never-on-a-command-line"
MOCKER_ARGS = {"block_size": 16, "speedup_ratio": 50.0, "num_gpu_blocks": 4096}


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    if why := missing_requirements():
        if os.environ.get("CI"):  # CI runs as root with openssh-server installed (make services)
            pytest.fail(f"remote-host tests cannot run: {why}")
        pytest.skip(why)
    hosts = SshHosts(tmp_path_factory.mktemp("ssh"))
    try:
        yield hosts
    finally:
        hosts.stop()


class RemoteGraph:
    """A graph file with the frontend here and one worker replica on each ssh host."""

    def __init__(self, tmp_path: Path, hosts: SshHosts, tiny_model: Path, **changes: Any) -> None:
        self.port = free_port()
        self.hosts = hosts
        self.file = tmp_path / "remote.yaml"
        self.state = tmp_path / ".dyngraph" / "remote"
        graph: dict[str, Any] = {
            "name": "remote",
            "runtime": {"discovery": "etcd", "request_plane": "tcp", "event_plane": "nats", "lease_ttl_s": 2},
            "infra": {"etcd": {"managed": True}, "nats": {"managed": True}},
            "hosts": hosts.graph_hosts(VENV),
            "models": {"tiny-model": {"path": str(tiny_model.resolve())}},
            "components": {
                "frontend": {"kind": "frontend", "http": {"port": self.port}, "migration_limit": 3},
                "backend": {
                    "kind": "worker",
                    "model": "tiny-model",
                    "engine": "echo_core",
                    "replicas": 2,
                    "placement": [h.key for h in hosts.hosts],
                    "migration_limit": 3,
                    "restart": {"backoff_s": 0.2},
                    "env": {"DYN_TOKEN_ECHO_DELAY_MS": "0", "HF_TOKEN": SECRET},
                },
            },
        }
        for key, value in changes.items():  # "a.b.c": value (None: leave it out)
            node = graph
            *path, last = key.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
            if value is None:
                del node[last]
        self.file.write_text(yaml.safe_dump(graph, sort_keys=False))

    @property
    def base_url(self) -> str:
        """The frontend's (as tests.support.processes.ServerProcess has it, for the routing helpers)."""
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return run_cli([args[0], str(self.file), *args[1:]], timeout=timeout)

    def processes(self) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in json.loads((self.state / "processes.json").read_text())}

    def chat(self) -> str:
        client = OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=10
        )
        reply = client.chat.completions.create(
            model="tiny-model",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=4,
            extra_body={"nvext": {"ignore_eos": True}},
        )
        return reply.choices[0].message.content or ""

    def remote_pids(self) -> list[int]:
        """Processes on the hosts other than their sshd listener."""
        return [p for h in self.hosts.hosts for p in h.pids() if p != h.sshd_pid()]

    def local_ports(self) -> list[tuple[str, int]]:
        """Where the frontend and the managed etcd / nats listen here."""
        ports = json.loads((self.state / "ports.json").read_text()).values()
        gateway = self.hosts.hosts[0].gateway
        return [("127.0.0.1", self.port)] + [(gateway, p) for p in ports]


@pytest.fixture
def make_graph(tmp_path: Path, ssh_hosts: SshHosts, tiny_model: Path) -> Iterator[Callable[..., RemoteGraph]]:
    made: list[RemoteGraph] = []

    def make(**changes: Any) -> RemoteGraph:
        graph = RemoteGraph(tmp_path, ssh_hosts, tiny_model, **changes)
        made.append(graph)
        return graph

    yield make
    for graph in made:
        graph.cli("down")


class Load:
    """Chat requests one after another in a thread, until stopped (at most 400 or 60 s)."""

    def __init__(self, graph: RemoteGraph) -> None:
        self.graph = graph
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while not self._stop.is_set() and self.ok + len(self.errors) < 400 and time.monotonic() < deadline:
            try:
                self.graph.chat()
                self.ok += 1
            except Exception as e:
                self.errors.append(repr(e))
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def _state(graph: RemoteGraph, name: str) -> str:
    return graph.processes()[name]["state"]


def _restarted(graph: RemoteGraph, name: str, old_pid: int) -> bool:
    record = graph.processes()[name]
    return record["state"] == "ready" and record["pid"] not in (None, old_pid)


def test_remote_workers_serve_restart_reconnect_and_down(
    make_graph: Callable[..., RemoteGraph], ssh_hosts: SshHosts
) -> None:
    graph = make_graph()
    up = graph.cli("up", "-d")
    assert up.returncode == 0, up.stdout + up.stderr
    assert graph.chat()
    records = graph.processes()
    h0, h1 = ssh_hosts.hosts
    assert records["backend-0"]["host"] == "h0" and records["backend-0"]["pid"] in h0.pids()
    assert records["backend-1"]["host"] == "h1" and records["backend-1"]["pid"] in h1.pids()

    status = graph.cli("status")
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in status.stdout.splitlines() if "│" in line]
    hosts = {row[0]: (row[1], row[3]) for row in cells}
    assert hosts["backend-0"] == ("h0", "ready") and hosts["backend-1"] == ("h1", "ready"), status.stdout
    assert hosts["frontend-0"] == ("local", "ready"), status.stdout

    # Each worker's own /metrics listens on its host's address, where `render -f prometheus` says,
    # over HTTPS for the graph's scraper certificate (TLS is on across the hosts).
    rendered = graph.cli("render", "-f", "prometheus")
    jobs = {job["job_name"]: job for job in yaml.safe_load(rendered.stdout)["scrape_configs"]}
    backend = jobs["remote-backend"]
    targets = {s["labels"]["process"]: s["targets"][0] for s in backend["static_configs"]}
    assert sorted(targets) == ["backend-0", "backend-1"]
    for process, host in (("backend-0", h0), ("backend-1", h1)):
        assert targets[process].startswith(f"{host.address}:")
        metrics = scrape(backend, targets[process])
        assert 'dyngraph_worker_max_inflight{model="tiny-model"} 1024.0' in metrics

    # The secret reached the workers' environment, and no command line on either host.
    remote = graph.remote_pids()
    assert any(SECRET.encode() in Path(f"/proc/{p}/environ").read_bytes() for p in remote if pid_alive(p))
    cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in remote if pid_alive(p)]
    assert len(cmdlines) >= 4 and not [c for c in cmdlines if SECRET.encode() in c]

    # kill -9 of a remote worker: restarted per policy; requests keep succeeding meanwhile.
    load = Load(graph)
    wait_for(lambda: load.ok >= 3, 20, "requests before the kill")
    victim = records["backend-0"]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: _restarted(graph, "backend-0", victim), 30, "backend-0 restarted")
    done = load.ok
    wait_for(lambda: load.ok >= done + 3, 20, "requests after the restart")
    load.stop()
    assert load.errors == [], load.errors[:3]
    assert graph.processes()["backend-0"]["restarts"] == 1
    assert graph.processes()["backend-0"]["pid"] in h0.pids()

    # Cut the ssh connection to h1 (kill the sshd child serving it) while h1's sshd takes no new
    # ones: the worker runs on, status shows h1 disconnected; once sshd answers again the
    # supervisor re-attaches it: the same pid, no restart counted.
    old = graph.processes()["backend-1"]
    cut_connection(h1)
    try:
        wait_for(
            lambda: graph.processes()["backend-1"]["state"] == "reconnecting", 15, "backend-1 reconnecting"
        )
        status = run_cli(["status", str(graph.file)], env={"COLUMNS": "200"})
        row = next(line for line in status.stdout.splitlines() if "h1" in line)
        assert "h1 (disconnected)" in row and "reconnecting" in row and str(old["pid"]) in row, status.stdout
        assert pid_alive(old["pid"])
    finally:
        os.kill(h1.sshd_pid(), signal.SIGCONT)
    wait_for(lambda: _state(graph, "backend-1") == "ready", 30, "backend-1 re-attached")
    again = graph.processes()["backend-1"]
    assert (again["pid"], again["restarts"]) == (old["pid"], old["restarts"])
    assert "re-attached on host 'h1'" in (graph.state / "logs/backend-1.log").read_text()
    wait_for(lambda: _answers(graph), 15, "the graph to answer again")

    # Cut again, and the worker dies while nobody watches it: once back, the supervisor learns its
    # exit and restarts it per policy (counted), on h1 again.
    cut_connection(h1)
    try:
        wait_for(
            lambda: graph.processes()["backend-1"]["state"] == "reconnecting", 15, "backend-1 reconnecting"
        )
        os.kill(old["pid"], signal.SIGKILL)
    finally:
        os.kill(h1.sshd_pid(), signal.SIGCONT)
    wait_for(lambda: _restarted(graph, "backend-1", old["pid"]), 30, "backend-1 restarted")
    assert graph.processes()["backend-1"]["restarts"] == old["restarts"] + 1
    assert graph.processes()["backend-1"]["pid"] in h1.pids()
    wait_for(lambda: _answers(graph), 15, "the graph to answer again")

    # Scale out while it runs: one more replica, on h0 (round-robin placement); nothing else restarts.
    before = {name: record["pid"] for name, record in graph.processes().items()}
    scaled = graph.cli("up", "-d", "components.backend.replicas=3")
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert [line for line in scaled.stdout.splitlines() if line[:2] in ("+ ", "~ ", "- ")] == ["+ backend-2"]
    after = graph.processes()
    assert (after["backend-2"]["host"], after["backend-2"]["state"]) == ("h0", "ready")
    assert after["backend-2"]["pid"] in h0.pids()
    assert {name: after[name]["pid"] for name in before} == before

    pids = graph.remote_pids()
    ports = graph.local_ports()
    down = graph.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert graph.remote_pids() == [] and not [p for p in pids if pid_alive(p)]
    assert h0.listening_ports() == [] and h1.listening_ports() == []
    assert [(a, port) for a, port in ports if not port_refuses(port, a)] == []


def cut_connection(host: SshHost) -> None:
    """Kill the sshd children serving the supervisor's connections to `host`, with its sshd
    listener stopped (SIGSTOP: new connections wait) until the caller sends SIGCONT."""
    sessions = host.session_pids()
    assert sessions, f"the supervisor holds a connection to {host.key}"
    os.kill(host.sshd_pid(), signal.SIGSTOP)
    for pid in sessions:
        os.kill(pid, signal.SIGKILL)


def _answers(graph: RemoteGraph) -> bool:
    try:
        return bool(graph.chat())
    except Exception:
        return False


def test_auto_ports_remote_frontend_and_supervisor_killed_leaves_no_orphan(
    make_graph: Callable[..., RemoteGraph], ssh_hosts: SshHosts
) -> None:
    # Two more frontends with `auto` ports: `side` here, `edge` on h1's loopback, where only a
    # probe made from h1 (through ssh) sees it; its port is one that was free on h1.
    graph = make_graph(
        **{
            "components.side": {"kind": "frontend", "http": {"port": "auto"}},
            "components.edge": {"kind": "frontend", "host": "h1", "http": {"port": "auto"}},
        }
    )
    up = graph.cli("up", "-d")
    assert up.returncode == 0, up.stdout + up.stderr
    ports = json.loads((graph.state / "ports.json").read_text())
    edge_port, side_port = ports["edge-0.http"], ports["side-0.http"]
    assert f"edge-0: http://127.0.0.1:{edge_port}/v1 on host h1" in up.stdout
    assert f"side-0: http://127.0.0.1:{side_port}/v1" in up.stdout
    assert graph.processes()["edge-0"]["state"] == "ready" and port_refuses(edge_port)
    assert edge_port in ssh_hosts.hosts[1].listening_ports()
    side = OpenAI(base_url=f"http://127.0.0.1:{side_port}/v1", api_key="none", max_retries=0, timeout=10)
    assert [m.id for m in side.models.list().data] == ["tiny-model"]
    remote = graph.remote_pids()
    assert remote
    supervisor = json.loads((graph.state / "supervisor.pid").read_text())["pid"]
    os.kill(supervisor, signal.SIGKILL)
    # Nobody re-attaches them: their agents stop them once agent.REATTACH_S has passed.
    wait_for(lambda: graph.remote_pids() == [], 15 + REATTACH_S, "the remote processes to stop")
    assert not [p for p in remote if pid_alive(p)]
    down = graph.cli("down")  # stops the local orphans (frontend, etcd, nats) and checks the hosts
    assert down.returncode == 0, down.stdout + down.stderr
    assert [(a, port) for a, port in graph.local_ports() if not port_refuses(port, a)] == []


def test_smoke_fault_kills_a_remote_replica_and_the_graph_heals(
    make_graph: Callable[..., RemoteGraph], ssh_hosts: SshHosts
) -> None:
    """`dyngraph test` faults reach remote processes: the agent signals the replica on h2, the
    supervisor restarts it there, and the chats around the fault are answered."""
    chat = {"chat": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}}
    graph = make_graph(
        tests=[
            chat,
            {"fault": {"kill": "backend", "replica": 1, "wait_ready": True}},
            chat,
            {"fault": {"kill": "backend", "replica": 0, "signal": "SIGTERM"}},
            chat,
        ]
    )
    done = graph.cli("test", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"SIGKILL to pid \d+; ready again as pid \d+", done.stdout), done.stdout
    assert re.search(r"SIGTERM to pid \d+", done.stdout), done.stdout
    assert graph.remote_pids() == []  # torn down on both hosts


def test_rendered_shell_script_runs_the_graph_over_ssh(
    make_graph: Callable[..., RemoteGraph], tmp_path: Path
) -> None:
    """`render -f shell` is what `up` runs: the script, run as it is, serves the graph through ssh
    and the agents, and killing it leaves nothing on the hosts."""
    graph = make_graph()
    render = graph.cli("render", "-f", "shell")
    assert render.returncode == 0, render.stderr
    assert render.stdout.count("| ssh ") == 2 and SECRET not in render.stdout
    script = tmp_path / "graph.sh"
    script.write_text(render.stdout.replace("***", SECRET))  # secrets are the reader's to fill in
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}", "DYN_TOKEN_ECHO_DELAY_MS": "0"}
    with (tmp_path / "graph.out").open("wb") as out:
        proc = subprocess.Popen(
            ["bash", str(script)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(lambda: _answers(graph), 60, "the hand-run graph to answer")
        assert len(graph.remote_pids()) >= 4  # an sshd session child and an agent per worker, the workers
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    wait_for(lambda: graph.remote_pids() == [], 15, "the remote workers to stop with their ssh sessions")
    wait_for(lambda: not _group_alive(proc.pid), 15, "the script's local processes to stop")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_partition_stops_the_remote_process_and_the_graph_heals(
    make_graph: Callable[..., RemoteGraph], ssh_hosts: SshHosts
) -> None:
    """A silent network partition (no FIN, no RST). A short one, that the supervisor notices
    (keepalives) but that ends within REATTACH_S: the worker ran on and is re-attached, no restart.
    One that lasts: the agent's heartbeat watchdog notices, waits REATTACH_S for the supervisor,
    then stops the worker on the far side; once the network is back the supervisor reconnects
    and restarts it."""
    graph = make_graph(**{"components.backend.restart.max_restarts": 20})
    up = graph.cli("up", "-d")
    assert up.returncode == 0, up.stdout + up.stderr
    h1 = ssh_hosts.hosts[1]
    worker = graph.processes()["backend-1"]["pid"]
    subprocess.run(["ip", "link", "set", h1.veth, "down"], check=True)
    try:
        wait_for(lambda: _state(graph, "backend-1") == "reconnecting", 20, "the supervisor to notice")
    finally:
        subprocess.run(["ip", "link", "set", h1.veth, "up"], check=True)
    wait_for(lambda: _state(graph, "backend-1") == "ready", REATTACH_S + 10, "backend-1 re-attached")
    assert (graph.processes()["backend-1"]["pid"], graph.processes()["backend-1"]["restarts"]) == (worker, 0)
    wait_for(lambda: _answers(graph), 15, "the graph to answer again")

    subprocess.run(["ip", "link", "set", h1.veth, "down"], check=True)
    try:
        started = time.monotonic()
        wait_for(
            lambda: not pid_alive(worker),
            30 + REATTACH_S,
            "the partitioned worker to be stopped by its agent",
        )
        assert time.monotonic() - started >= 4 + REATTACH_S  # the heartbeat ran out, then the wait
    finally:
        subprocess.run(["ip", "link", "set", h1.veth, "up"], check=True)
    wait_for(lambda: _restarted(graph, "backend-1", worker), 60, "backend-1 back once the network is")
    wait_for(lambda: _answers(graph), 15, "the graph to answer again")
    down = graph.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert graph.remote_pids() == []


def test_down_while_a_host_is_disconnected_stops_its_process_once_re_attached(
    make_graph: Callable[..., RemoteGraph], ssh_hosts: SshHosts
) -> None:
    """`down` during a reconnect: the `term` goes out over the re-attached channel, and nothing of
    the graph is left on the host."""
    graph = make_graph()
    up = graph.cli("up", "-d")
    assert up.returncode == 0, up.stdout + up.stderr
    h1 = ssh_hosts.hosts[1]
    worker = graph.processes()["backend-1"]["pid"]
    cut_connection(h1)
    try:
        wait_for(lambda: _state(graph, "backend-1") == "reconnecting", 15, "backend-1 reconnecting")
        down = subprocess.Popen(
            [*DYNGRAPH, "down", str(graph.file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        time.sleep(1.0)  # a non-event (down keeps waiting) can only be checked after a while
        assert down.poll() is None and pid_alive(worker)  # waiting for h1
    finally:
        os.kill(h1.sshd_pid(), signal.SIGCONT)
    out, _ = down.communicate(timeout=60)
    assert down.returncode == 0, out
    assert not pid_alive(worker) and graph.remote_pids() == []
    assert "re-attached on host 'h1'" in (graph.state / "logs/backend-1.log").read_text()


def test_kv_router_here_follows_zmq_kv_events_of_workers_on_both_hosts(
    make_graph: Callable[..., RemoteGraph],
) -> None:
    """KV events over zmq across hosts: each remote worker's publisher binds and announces its
    host's address, the kv router here subscribes to both, and a conversation's follow-up goes to
    the worker that holds its blocks, with the overlap the router learnt from that worker's events
    (with events on, the router's index knows only what events told it)."""
    graph = make_graph(
        **{
            "runtime.event_plane": "zmq",
            # Dynamo's cost spreads these one-at-a-time openings over both workers; the predictive
            # cost (the default) rightly keeps them all on the worker holding the template's
            # first block while nothing is queued, and the test needs events from both hosts.
            "components.frontend.router": {"mode": "kv", "cost": "dynamo"},
            "components.frontend.env": {"DYN_LOG": "info,dynamo_graph.router=debug"},
            "components.backend.engine": "mocker",
            "components.backend.engine_args": {
                "block_size": 16,
                "speedup_ratio": 50.0,
                "num_gpu_blocks": 4096,
            },
        }
    )
    up = graph.cli("up", "-d")
    assert up.returncode == 0, up.stdout + up.stderr
    hosts = {_instance_of(graph, f"backend-{i}"): f"h{i}" for i in range(2)}
    http = httpx.Client(base_url=graph.base_url, timeout=30)

    def chat(messages: list[dict]) -> dict:
        body = {"model": "tiny-model", "messages": messages, "max_tokens": 8}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    served: dict[str, int] = {}
    for conv in range(8):
        messages = opening_messages(conv)
        home, first = served_by(graph, "tiny-model", lambda m=messages: chat(m))
        messages += [first["choices"][0]["message"], {"role": "user", "content": "And now?"}]
        again, _ = served_by(graph, "tiny-model", lambda m=messages: chat(m))
        assert again == home, f"conversation {conv}'s follow-up left {hosts[home]}"
        served[hosts[home]] = served.get(hosts[home], 0) + 1
    assert set(served) == {"h0", "h1"}, served
    # The router saw overlap on both hosts' workers: their events reached it across the veths.
    routed = re.findall(
        r"-> ([0-9a-f]+) rank 0 \(overlap (\d+) of", (graph.state / "logs/frontend-0.log").read_text()
    )
    overlapped = {hosts[instance] for instance, blocks in routed if int(blocks) > 0}
    assert overlapped == {"h0", "h1"}, routed


def _instance_of(graph: RemoteGraph, process: str) -> str:
    """A worker's instance id (hex), from the line it logs when it serves."""
    found = re.search(r"instance ([0-9a-f]+) serving", (graph.state / f"logs/{process}.log").read_text())
    assert found, process
    return found.group(1)


def test_preflight_reports_every_host_problem_and_starts_nothing(
    make_graph: Callable[..., RemoteGraph], ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong_key = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    h0_ssh, h1_ssh = (ssh_hosts.graph_hosts(VENV)[h]["ssh"] for h in ("h0", "h1"))
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    graph = make_graph(
        **{
            "hosts.h0.ssh.known_hosts": None,
            "hosts.h0.ssh.host_key": wrong_key,
            "hosts.h1.gpus": 1,
            "hosts.h1.workdir": "/nonexistent/workdir",
            "models.elsewhere": {"path": "/nonexistent/dyngraph-model"},
            # h0 again as: h5 with an empty known_hosts (unknown key), h6 with a python that lacks
            # dyngraph, h7 with no python at all, h9 on a port nothing listens on; h8: h1 with a key
            # that h1 does not accept
            "hosts.h5": {"ssh": {**h0_ssh, "known_hosts": str(empty)}, "venv": str(VENV)},
            "hosts.h6": {"ssh": h0_ssh, "python": "/usr/bin/python3"},
            "hosts.h7": {"ssh": h0_ssh, "python": "/nonexistent/bin/python3"},
            "hosts.h8": {"ssh": {**h1_ssh, "identity_file": str(other)}, "venv": str(VENV)},
            "hosts.h9": {"ssh": {**h0_ssh, "port": 2222}, "venv": str(VENV)},
            "components.far": {
                "kind": "worker",
                "model": "tiny-model",
                "engine": "echo_core",
                "replicas": 5,
                "placement": ["h5", "h6", "h7", "h8", "h9"],
            },
            "components.gpu-worker": {  # an engine that computes on GPUs (the echo ones need none)
                "kind": "worker",
                "model": "elsewhere",
                "engine": "mistralrs",
                "placement": ["h1"],
                "gpus": {"per_replica": 1},
            },
        }
    )
    before = graph.remote_pids()
    started = time.monotonic()
    up = graph.cli("up", "-d")
    elapsed = time.monotonic() - started
    assert up.returncode == 2, up.stdout + up.stderr
    assert elapsed < 20
    errors = [line for line in up.stderr.splitlines() if line.startswith("error:")]
    text = "\n".join(errors)
    assert len(errors) == 9, up.stderr
    assert "hosts.h0.ssh.host_key: host 'h0'" in text and "host key refused" in text
    assert f"{graph.file}:" in text  # file:line of the key
    assert "models.elsewhere.path: host 'h1': /nonexistent/dyngraph-model does not exist" in text
    assert "hosts.h1.workdir: host 'h1': /nonexistent/workdir does not exist" in text
    assert "hosts.h1.gpus: host 'h1': the placement needs 1 GPU(s)" in text and "has 0" in text
    assert (
        f"hosts.h8.ssh.identity_file: host 'h8' (root@{h1_ssh['address']}:22): authentication refused" in text
    )
    assert f"hosts.h9.ssh.address: host 'h9' (root@{h0_ssh['address']}:2222): unreachable" in text
    assert "hosts.h5.ssh.known_hosts: host 'h5'" in text and "host key refused" in text
    assert "hosts.h6.python: host 'h6'" in text and "dyngraph is not installed for /usr/bin/python3" in text
    assert "hosts.h7.python: host 'h7'" in text and "/nonexistent/bin/python3 not found" in text
    # Nothing started anywhere: no supervisor, no process on the hosts, nothing listening here
    # (the sshd children of preflight's connections end with them).
    wait_for(lambda: graph.remote_pids() == before, 5, "preflight's ssh sessions to end")
    assert not (graph.state / "supervisor.pid").exists()
    records = graph.state / "processes.json"  # the spawned supervisor stopped with an empty plan
    assert not records.exists() or json.loads(records.read_text()) == []
    assert port_refuses(graph.port)


async def test_more_processes_than_one_connection_may_carry(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    """sshd allows 10 sessions per connection by default: the 11th process gets a second one."""
    h0 = ssh_hosts.hosts[0]
    graph_host = ssh_hosts.graph_hosts(VENV)["h0"]["ssh"]
    remote = RemoteHost(
        address=h0.address,
        user="root",
        identity_file=graph_host["identity_file"],
        known_hosts=graph_host["known_hosts"],
        python=str(VENV / "bin" / "python"),
    )
    pool = SshHosts_(dict(h0=remote))
    restart = RestartPolicy("never", 0, 1.0, 1.0)
    procs = [
        RemoteProcess(
            ProcessSpec(
                f"sleep-{i}",
                "sleep",
                i,
                "h0",
                ["sleep", "60"],
                {},
                "/",
                {},
                [],
                Probe("log", "-", 1.0),
                restart,
                2.0,
            ),
            tmp_path / f"sleep-{i}.log",
            pool,
            "dg-sessions-test",
        )
        for i in range(12)
    ]
    try:
        for i, proc in enumerate(procs):
            await proc.start(i)
        assert all(proc.pid in h0.pids() for proc in procs)
        assert len(h0.session_pids()) == 2
    finally:
        codes = [await proc.stop() for proc in procs]
        await pool.close()
    assert codes == [-signal.SIGTERM] * 12
    assert not [p for p in procs if p.pid and pid_alive(p.pid)]


async def test_side_channel_ports_of_replicas_on_one_host_are_distinct_and_free_there(
    ssh_hosts: SshHosts, tmp_path: Path, tiny_model: Path
) -> None:
    """vLLM prefill/decode workers, two of each on h0: each process's NIXL side-channel port is
    one of its own, free on h0 when `up` asks (the agent's `ports`), and bound on h0's address."""
    graph = RemoteGraph(
        tmp_path,
        ssh_hosts,
        tiny_model,
        **{
            "components.backend": None,
            **{
                f"components.{role}": {
                    "kind": "worker",
                    "model": "tiny-model",
                    "engine": "vllm",
                    "role": role,
                    "replicas": 2,
                    "placement": ["h0"],
                    "engine_args": {"kv_transfer_config": {"kv_connector": "NixlConnector"}},
                }
                for role in ("prefill", "decode")
            },
        },
    )
    plan = build(graph.file, []).plan
    pool = SshHosts_(dict(plan.hosts))
    ports: dict[str, int] = {}
    try:
        await pool.allocate_ports(plan, ports)
    finally:
        await pool.close()
    workers = [p for p in fill_plan(plan, ports).processes if p.host == "h0"]
    side = {p.name: int(p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for p in workers}
    assert sorted(side) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert len(set(side.values())) == 4 and side == {n: ports[f"{n}.nixl"] for n in side}
    h0 = ssh_hosts.hosts[0]
    assert {p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for p in workers} == {h0.address}
    assert not set(side.values()) & set(h0.listening_ports())


def test_a_change_rolls_the_remote_workers_and_rollback_too_failing_no_request(
    make_graph: Callable[..., RemoteGraph],
) -> None:
    """Rolling updates on ssh hosts: each worker's new run starts on its host beside the old one
    and must be listed by the frontend here before the old one retires; streamed load with no
    retries sees no error, through the change and its rollback."""
    graph = make_graph(
        **{"components.frontend.migration_limit": None, "components.backend.migration_limit": None}
    )
    assert graph.cli("up", "-d").returncode == 0
    before = graph.processes()
    with StreamingLoad(f"{graph.base_url}/v1", "tiny-model", clients=3) as load:
        load.wait_for_requests(20)
        make_graph(
            **{
                "components.frontend.migration_limit": None,
                "components.backend.migration_limit": None,
                "components.backend.env.DYN_TOKEN_ECHO_DELAY_MS": "1",
                "components.frontend.http.port": graph.port,
            }
        )
        changed = graph.cli("up", "-d", timeout=180)
        assert changed.returncode == 0, changed.stdout + changed.stderr
        assert "~ backend-0" in changed.stdout and "~ backend-1" in changed.stdout
        after = graph.processes()
        for name, host in (("backend-0", "h0"), ("backend-1", "h1")):
            assert after[name]["host"] == host and after[name]["pid"] != before[name]["pid"]
        assert after["frontend-0"]["pid"] == before["frontend-0"]["pid"]
        load.wait_for_requests(20)
        back = graph.cli("rollback", timeout=180)
        assert back.returncode == 0, back.stdout + back.stderr
        load.wait_for_requests(20)
    result = load.result
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"
    history = graph.cli("history")
    assert "rollback 1" in history.stdout, history.stdout


def test_a_canary_on_the_hosts_that_answers_slower_is_rolled_back_failing_no_request(
    make_graph: Callable[..., RemoteGraph],
) -> None:
    """A canary on ssh hosts: the split lives in the graph's etcd, the new worker on its host
    takes half the requests, its first tokens come 40 ms later than the old ones', and the
    comparison rolls it back; the old workers serve on and no request fails."""
    canary = {
        "strategy": "canary",
        "steps": [50, 100],
        "pause_s": 2,
        "min_requests": 5,
        "max_ttft_p90_ratio": 3,
    }
    graph = make_graph(**{"components.backend.rollout": canary})
    assert graph.cli("up", "-d").returncode == 0
    before = graph.processes()
    with StreamingLoad(f"{graph.base_url}/v1", "tiny-model", clients=3) as load:
        load.wait_for_requests(20)
        make_graph(
            **{
                "components.backend.rollout": canary,
                "components.backend.env.DYN_TOKEN_ECHO_DELAY_MS": "40",
                "components.frontend.http.port": graph.port,
            }
        )
        slow = graph.cli("up", "-d", timeout=180)
        assert slow.returncode == 1, slow.stdout + slow.stderr
        assert "canary backend, step 1 of 2" in slow.stdout and "TTFT p90" in slow.stdout, slow.stdout
        assert "rolled back" in slow.stdout
        after = graph.processes()
        assert {n: r["pid"] for n, r in after.items() if not r.get("retiring")} == {
            n: r["pid"] for n, r in before.items()
        }
        load.wait_for_requests(20)
    result = load.result
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"


def test_the_autoscaler_adds_a_replica_on_the_second_host_and_retires_it_losing_nothing(
    make_graph: Callable[..., RemoteGraph],
) -> None:
    """Autoscaling on ssh hosts: a busy pool of one mocker on h0 grows a replica on h1 (its
    placement's next host), then, idle, retires it there; streamed load with no retries sees no
    error throughout."""
    graph = make_graph(
        **{
            "components.backend.engine": "mocker",
            "components.backend.engine_args": {"max_num_seqs": 2, "speedup_ratio": 1.0, "block_size": 16},
            "components.backend.replicas": 1,
            "components.backend.autoscale": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target": {"ttft_p90_ms": 150},
                "interval_s": 1,
                "scale_down_delay_s": 3,
            },
        }
    )
    up = graph.cli("up", "-d")
    assert up.returncode == 0, up.stdout + up.stderr
    with StreamingLoad(f"{graph.base_url}/v1", "tiny-model", clients=8) as load:
        deadline = time.monotonic() + 60
        while "backend-1" not in graph.processes() or _state(graph, "backend-1") != "ready":
            assert time.monotonic() < deadline, "the pool did not grow to the second host"
            time.sleep(0.25)
        assert graph.processes()["backend-1"]["host"] == "h1"
        load.wait_for_requests(20)
    result = load.result
    deadline = time.monotonic() + 60
    while "backend-1" in graph.processes():
        assert time.monotonic() < deadline, "the idle pool did not shrink back"
        time.sleep(0.25)
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"
    assert graph.chat()


def test_a_broken_revision_is_refused_and_a_scale_down_retires_the_remote_replica_failing_nothing(
    make_graph: Callable[..., RemoteGraph],
) -> None:
    """On the ssh hosts, under streamed load with no retries: a revision whose engine cannot
    load is rolled back while the running workers serve on, then scaling 2 -> 1 retires the
    replica on h1 (its streams finish); no request fails."""
    graph = make_graph()
    assert graph.cli("up", "-d").returncode == 0
    before = {n: r["pid"] for n, r in graph.processes().items()}
    with StreamingLoad(f"{graph.base_url}/v1", "tiny-model", clients=3) as load:
        load.wait_for_requests(20)
        make_graph(
            **{
                "components.backend.engine": "mocker",
                "components.backend.engine_args": {"speedup_ratio": "not a number"},
                "components.frontend.http.port": graph.port,
            }
        )
        broken = graph.cli("up", "-d", timeout=180)
        assert broken.returncode == 1, broken.stdout + broken.stderr
        assert "failed" in broken.stdout and "rolled back" in broken.stdout, broken.stdout
        assert {n: r["pid"] for n, r in graph.processes().items() if not r.get("retiring")} == before
        load.wait_for_requests(20)
        make_graph(**{"components.backend.replicas": 1, "components.frontend.http.port": graph.port})
        down = graph.cli("up", "-d", timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "- backend-1" in down.stdout
        load.wait_for_requests(20)
    result = load.result
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"
    assert "backend-1" not in graph.processes()


PROMPT = "the launch code is tangerine 4711"


def test_tls_auto_carries_certificates_over_ssh_refuses_outsiders_and_hides_traffic(
    make_graph: Callable[..., RemoteGraph], ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    """`security.tls: auto` (the default) across the hosts: each remote worker's key and
    certificates arrive over its ssh channel into the agent's private folder (0600), its ports
    refuse a client without the graph's certificate, and a capture on the veth shows neither the
    prompt nor the model's name or endpoint, which a plain request frame carries."""
    h0, _ = ssh_hosts.hosts
    capture = tmp_path / "veth.pcap"
    dump = subprocess.Popen(
        ["tcpdump", "-i", h0.veth, "-U", "-s", "0", "-w", str(capture), "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert dump.stderr is not None and b"listening on" in dump.stderr.readline()
        graph = make_graph()
        up = graph.cli("up", "-d")
        assert up.returncode == 0, up.stdout + up.stderr
        client = OpenAI(base_url=f"{graph.base_url}/v1", api_key="none", max_retries=0, timeout=10)
        for _ in range(2):  # round robin: one request through each host
            reply = client.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": PROMPT}], max_tokens=8
            )
            assert reply.choices[0].message.content
    finally:
        dump.send_signal(signal.SIGINT)
        dump.wait(10)
    wire = capture.read_bytes()
    assert b"SSH-2.0-" in wire  # the capture saw the graph come up: ssh's greeting is in the clear
    for text in (PROMPT, "tangerine", "tiny-model", "backend.generate"):
        assert text.encode() not in wire, f"{text!r} crossed the veth in the clear"

    worker = graph.processes()["backend-0"]
    environ = dict(
        var.split(b"=", 1)
        for var in Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
        if b"=" in var
    )
    key = Path(environ[b"DYN_TLS_KEY_FILE"].decode())
    local_key = graph.state / "tls" / "backend-0.key"
    assert key.parent != local_key.parent and key.read_bytes() == local_key.read_bytes()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert b"PRIVATE KEY" not in Path(f"/proc/{worker['pid']}/cmdline").read_bytes()

    sockets = listening([worker["pid"]])
    assert sockets, "the worker listens on its request plane"
    for _, host, port in sockets:
        assert plain_answer(host, port) == b""
        refused = tls_without_certificate(host, port)
        assert isinstance(refused, str) or refused == b"", f"{host}:{port} served TLS without a certificate"
