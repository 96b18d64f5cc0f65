"""`security: {tls: required}` on one machine: a graph of a frontend, two mocker workers and
managed etcd + nats-server serves the official client, and every port its processes listen on
but the frontend's HTTP one refuses a peer without the graph's certificate: plain TCP and TLS
without a certificate get nothing served, nats-py and etcd without one cannot connect. No key
material in any process's command line or environment, in `status` or `render`; the workers'
and the supervisor's /metrics serve the graph's scraper certificate and nothing without one, and a
real Prometheus scrapes every target of `render -f prometheus`; a worker killed
with SIGKILL comes back and its callers reconnect; an `up` of a change rotates the certificates,
old and new processes still trusting each other.

One graph for the module (CI time); the ssh-host side of TLS is in test_remote_hosts.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import nats.errors
import pytest
import yaml
from openai import OpenAI

from dynamo_graph.graph.tls import ca_file, cert_files, issue_all
from dynamo_graph.runtime.discovery.base import DiscoveryError
from dynamo_graph.runtime.discovery.etcd import EtcdDiscovery
from tests.support.listeners import listening, plain_answer, tls_refuses, tls_without_certificate
from tests.support.local_graph import Graph
from tests.support.processes import free_port
from tests.support.prometheus import active_targets, all_up, needs_prometheus, prometheus, scrape
from tests.support.waiting import wait_for

# The CI graph with etcd and nats-server, with TLS required, the tcp request plane (so each worker
# listens) and the mocker.
TLS_REQUIRED = ("+security.tls=required", "runtime.request_plane=tcp", "components.backend.engine=mocker")


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Graph]:
    g = Graph("echo-etcd-nats.yaml", tmp_path_factory.mktemp("tls"), tiny_model)
    g.overrides += (*TLS_REQUIRED, f"supervisor.metrics_port={free_port()}")
    up = g.up()
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield g
    finally:
        g.cli("down")


def _client(graph: Graph) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{graph.port}/v1", api_key="none", max_retries=0, timeout=15)


def test_serves_the_official_client_streaming_and_not(graph: Graph) -> None:
    assert graph.chat()
    stream = _client(graph).chat.completions.create(
        model="tiny-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_no_listener_serves_a_peer_without_the_graph_certificate(graph: Graph) -> None:
    procs = graph.processes()
    sockets = listening([r["pid"] for r in procs.values()])
    ports = {port for _, _, port in sockets}
    assert graph.port in ports
    by_owner = {pid: name for name, r in procs.items() for pid in [r["pid"]]}
    checked = []
    for pid, host, port in sockets:
        if port == graph.port:
            continue  # the OpenAI-facing port: plain HTTP, as the graph says (no `http.tls`)
        answer = plain_answer(host, port)
        if answer.startswith(b"INFO "):  # nats-server (2.9) greets in the clear, then wants TLS
            info = json.loads(answer.split(b"\r\n", 1)[0][5:])
            assert info["tls_required"] and info["tls_verify"], info
            assert b"PONG" not in answer, "nats-server answered a client in the clear"
        else:
            assert answer == b"", f"port {port} answered plain TCP: {answer[:80]!r}"
            refused = tls_without_certificate(host, port)
            assert not (isinstance(refused, bytes) and refused), f"port {port} served TLS without a cert"
        checked.append(by_owner.get(pid, pid))
    # etcd (client and peer ports), nats, and each worker's request plane were all checked.
    assert checked.count("etcd") == 2 and "nats" in checked
    assert "backend-0" in checked and "backend-1" in checked


async def test_nats_and_etcd_refuse_a_client_without_a_certificate(
    graph: Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients that trust the graph's CA (so only their own certificate is missing)."""
    plan = {p["name"]: p for p in json.loads((graph.state / "plan.json").read_text())["processes"]}
    env = plan["backend-0"]["env"]
    trusting = ssl.create_default_context(cafile=env["NATS_TLS_CA"])
    with pytest.raises((OSError, nats.errors.Error)):
        await nats.connect(
            env["NATS_SERVER"], tls=trusting, tls_hostname="nats", allow_reconnect=False, connect_timeout=3
        )
    trusting.load_cert_chain(env["NATS_TLS_CERT"], env["NATS_TLS_KEY"])  # the control: a member gets in
    member = await nats.connect(env["NATS_SERVER"], tls=trusting, tls_hostname="nats", allow_reconnect=False)
    await member.close()
    monkeypatch.setenv("ETCD_AUTH_CA", env["ETCD_AUTH_CA"])
    monkeypatch.setenv("ETCD_AUTH_SERVER_NAME", "etcd")
    discovery = EtcdDiscovery([env["ETCD_ENDPOINTS"]], ttl_s=2)
    try:
        with pytest.raises(DiscoveryError, match="cannot grant a lease"):
            async with asyncio.timeout(20):
                await discovery.start()
    finally:
        with contextlib.suppress(DiscoveryError):
            await discovery.close()


def test_no_key_material_in_argv_env_status_or_render(graph: Graph) -> None:
    keys = [p.read_text().strip() for p in (graph.state / "tls").glob("*.key")]
    assert len(keys) >= 5  # CA, curve, etcd, nats, processes
    for record in graph.processes().values():
        pid = record["pid"]
        seen = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        assert b"PRIVATE KEY" not in seen and not any(k.encode() in seen for k in keys), record["name"]
    for args in (
        ("status", "--json"),
        ("render", *graph.overrides),
        ("render", "-f", "shell", *graph.overrides),
    ):
        out = graph.cli(*args)
        assert out.returncode == 0, out.stderr
        assert "PRIVATE KEY" not in out.stdout and not any(k in out.stdout for k in keys), args
    logs = "".join(p.read_text(errors="replace") for p in (graph.state / "logs").glob("*.log"))
    assert "PRIVATE KEY" not in logs and not any(k in logs for k in keys)


def _metrics_jobs(graph: Graph) -> tuple[str, dict[str, dict]]:
    """`render -f prometheus`'s text and its jobs by component."""
    rendered = graph.cli("render", "-f", "prometheus", *graph.overrides)
    assert rendered.returncode == 0, rendered.stderr
    jobs = yaml.safe_load(rendered.stdout)["scrape_configs"]
    return rendered.stdout, {job["static_configs"][0]["labels"]["component"]: job for job in jobs}


def test_metrics_answer_the_scraper_certificate_and_nobody_without_one(graph: Graph) -> None:
    text, jobs = _metrics_jobs(graph)
    keys = [p.read_text().strip() for p in (graph.state / "tls").glob("*.key")]
    assert "PRIVATE KEY" not in text and not any(k in text for k in keys)  # paths only
    no_certificate = ssl.create_default_context(cafile=jobs["backend"]["tls_config"]["ca_file"])
    series = {"backend": "dyngraph_worker_max_inflight", "supervisor": "dyngraph_replicas"}
    for component, name in series.items():
        job = jobs[component]
        assert job["scheme"] == "https"
        targets = [t for c in job["static_configs"] for t in c["targets"]]
        assert len(targets) == (2 if component == "backend" else 1)
        for target in targets:
            assert name in scrape(job, target)
            with pytest.raises(httpx.TransportError):  # the handshake wants a certificate of the CA
                httpx.get(f"https://{target}/metrics", verify=no_certificate, timeout=5)
    # The scraper's certificate is for /metrics alone: no other listener of a worker takes it.
    scraper = (jobs["backend"]["tls_config"]["cert_file"], jobs["backend"]["tls_config"]["key_file"])
    member = cert_files(graph.state / "tls", "frontend-0")
    backend = jobs["backend"]["static_configs"]
    metrics_ports = {int(t.rsplit(":", 1)[1]) for c in backend for t in c["targets"]}
    procs = graph.processes()
    others = [
        (host, port)
        for _, host, port in listening([procs["backend-0"]["pid"], procs["backend-1"]["pid"]])
        if port not in metrics_ports
    ]
    assert others  # the request plane's
    for host, port in others:
        assert tls_refuses(host, port, scraper), port
        assert not tls_refuses(host, port, member), port  # the control: a member is taken


@needs_prometheus
def test_prometheus_scrapes_every_target_of_a_tls_required_graph(graph: Graph) -> None:
    text, jobs = _metrics_jobs(graph)
    assert {"frontend", "backend", "supervisor"} <= set(jobs)
    with prometheus(text, graph.state.parent / "prometheus") as api:
        wait_for(lambda: all_up(api), 30, "every scrape target up")
        scraped = sorted(t["labels"].get("process", t["labels"]["component"]) for t in active_targets(api))
    assert scraped == ["backend-0", "backend-1", "frontend", "supervisor"]


def test_a_worker_killed_comes_back_and_is_reached_again(graph: Graph) -> None:
    old = graph.processes()["backend-0"]["pid"]
    os.kill(old, signal.SIGKILL)
    wait_for(
        lambda: (r := graph.processes()["backend-0"])["pid"] != old and r["state"] == "ready",
        30,
        "backend-0 to restart",
    )
    for _ in range(4):  # round robin: both workers, the restarted one over a new TLS connection
        assert graph.chat()


def test_an_up_rotates_the_certificates_and_moves_the_frontend_to_https(graph: Graph, tmp_path: Path) -> None:
    """A new revision issues every process a new certificate under the same CA: the workers that
    keep running (on their old ones) and the rolled frontend (on its new one) still trust each
    other. The change is the frontend's `http.tls`, so its readiness probe speaks HTTPS, and
    Prometheus scrapes it over HTTPS, verifying it with the `ca_file` the graph gives."""
    folder = graph.state / "tls"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    pids = {name: r["pid"] for name, r in graph.processes().items()}
    issue_all(tmp_path / "web", "web", {"api": []})  # the organisation's certificate, not the graph's
    cert, key = cert_files(tmp_path / "web", "api")
    https = f"{{cert_file: {cert}, key_file: {key}, ca_file: {ca_file(tmp_path / 'web')}}}"
    graph.overrides.append(f"+components.frontend.http.tls={https}")
    up = graph.up()
    assert up.returncode == 0, up.stdout + up.stderr
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    kept = ("ca.crt", "ca.key", "curve.key", "scrape-ca.crt", "scrape-ca.key")
    assert [after[n] == before[n] for n in kept] == [True] * 5
    rotated = [n for n in before if n.endswith((".crt", ".key")) and n not in kept]
    assert len(rotated) == 14 and all(after[n] != before[n] for n in rotated)
    procs = graph.processes()
    assert procs["backend-0"]["pid"] == pids["backend-0"] and procs["frontend-0"]["pid"] != pids["frontend-0"]
    verify = ssl.create_default_context(cafile=ca_file(tmp_path / "web"))
    with httpx.Client(verify=verify) as http:
        client = OpenAI(
            base_url=f"https://127.0.0.1:{graph.port}/v1", api_key="none", http_client=http, max_retries=0
        )
        for _ in range(2):  # both workers, each on its previous certificate
            reply = client.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].message.content
    if shutil.which("prometheus") is not None:
        text, jobs = _metrics_jobs(graph)
        assert jobs["frontend"]["scheme"] == "https"
        with prometheus(text, tmp_path / "prometheus") as api:
            wait_for(lambda: all_up(api), 30, "every scrape target up, the frontend over HTTPS")
