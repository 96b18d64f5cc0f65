"""`security.tls`: the graph's CA and certificates (names, expiry, file modes, rotation), what the
plan gives each process (paths, never contents), the ssh agent's private copies of carried files,
validation and `up`'s warning, and that no key material reaches `render` in any format."""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dynamo_graph.graph import tls
from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.targets.dispatch import FORMATS, render
from dynamo_graph.graph.targets.local.remote import agent_run
from dynamo_graph.graph.validate import tls_warnings

# Frontend and w-0 here, w-1 on gpu1; managed etcd and nats; KV events over zmq.
MULTI_HOST = yaml.safe_dump(
    {
        "name": "sec",
        "runtime": {"discovery": "etcd", "event_plane": "zmq"},
        "infra": {"etcd": {"managed": True}, "nats": {"managed": True}},
        "hosts": {
            "local": {"advertise_host": "10.0.0.1"},
            "gpu1": {"ssh": {"address": "10.0.0.2"}, "advertise_host": "10.0.0.2"},
        },
        "models": {"m": {"path": "/models/llama"}},
        "components": {
            "frontend": {"kind": "frontend"},
            "w": {
                "kind": "worker",
                "model": "m",
                "engine": "mocker",
                "replicas": 2,
                "placement": ["local", "gpu1"],
            },
        },
    }
)

ONE_HOST = """
name: one
models: {m: {path: /models/llama}}
components:
  frontend: {kind: frontend}
  w: {kind: worker, model: m, engine: mocker}
"""


def _build(tmp_path: Path, text: str, *overrides: str):  # -> Built
    path = tmp_path / "graph.yaml"
    path.write_text(text)
    return build(path, list(overrides))


def _sans(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    return ips, set(names.get_values_for_type(x509.DNSName))


# ---- the CA and its certificates ---------------------------------------------------------------


def test_ca_and_process_certificates(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    ca = tls.issue_all(folder, "g", {"w-0": ["10.0.0.2"], "etcd": ["10.0.0.1", "etcd"], "web-0": []})
    ca_cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    now = datetime.datetime.now(datetime.UTC)
    assert abs(
        (ca_cert.not_valid_after_utc - now) - datetime.timedelta(days=tls.CA_DAYS)
    ) < datetime.timedelta(minutes=1)
    cert = x509.load_pem_x509_certificate((folder / "w-0.crt").read_bytes())
    cert.verify_directly_issued_by(ca_cert)
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc <= ca_cert.not_valid_after_utc
    assert cert.not_valid_after_utc - now <= datetime.timedelta(days=tls.LEAF_DAYS)
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}  # server, client
    # The host's address and loopback, as IP addresses (not DNS names); a service's own name as DNS.
    assert _sans(cert) == ({"10.0.0.2", "127.0.0.1", "::1"}, {"localhost"})
    assert _sans(x509.load_pem_x509_certificate((folder / "etcd.crt").read_bytes())) == (
        {"10.0.0.1", "127.0.0.1", "::1"},
        {"etcd", "localhost"},
    )
    key = serialization.load_pem_private_key((folder / "w-0.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    # Only the user may enter the folder or read any file in it.
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    assert {p.name for p in folder.iterdir()} == {
        *("ca.crt", "ca.key", "curve.key", "w-0.crt", "w-0.key"),
        *("etcd.crt", "etcd.key", "web-0.crt", "web-0.key"),
    }
    assert len((folder / "curve.key").read_bytes().strip()) == 40  # a z85 CURVE secret key
    assert ca.renewed


def test_rotation_keeps_the_ca_and_renews_it_only_when_due_and_allowed(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    first = tls.issue_all(folder, "g", {"w-0": []})
    key_before = (folder / "w-0.key").read_bytes()
    curve_before = (folder / "curve.key").read_bytes()
    again = tls.issue_all(folder, "g", {"w-0": []})
    assert not again.renewed and again.cert == first.cert  # the same CA: old and new runs trust each other
    assert (folder / "w-0.key").read_bytes() != key_before  # a fresh key per revision
    assert (folder / "curve.key").read_bytes() == curve_before
    # A CA with less than CA_RENEW_DAYS left: kept while processes trust it, replaced otherwise.
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=tls.CA_RENEW_DAYS - 1)
    due = (
        x509.CertificateBuilder()
        .subject_name(first.cert.subject)
        .issuer_name(first.cert.subject)
        .public_key(first.key.public_key())
        .serial_number(1)
        .not_valid_before(datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1))
        .not_valid_after(soon)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(first.key, tls.hashes.SHA256())
    )
    (folder / "ca.crt").write_bytes(due.public_bytes(serialization.Encoding.PEM))
    kept = tls.issue_all(folder, "g", {"w-0": []}, renew=False)
    assert not kept.renewed and kept.days_left() < tls.CA_RENEW_DAYS
    leaf = x509.load_pem_x509_certificate((folder / "w-0.crt").read_bytes())
    assert leaf.not_valid_after_utc <= soon  # never outlives its CA
    renewed = tls.issue_all(folder, "g", {"w-0": []})
    assert renewed.renewed and renewed.days_left() > tls.CA_DAYS - 1
    assert (folder / "curve.key").read_bytes() != curve_before  # replaced with the CA


# ---- the plan ----------------------------------------------------------------------------------


def test_auto_is_on_across_hosts_and_gives_every_process_paths(tmp_path: Path) -> None:
    plan = _build(tmp_path, MULTI_HOST).plan
    assert plan.tls is not None
    folder = plan.tls.dir
    assert folder == str(tmp_path / ".dyngraph" / "graph" / "tls")
    assert plan.tls.names == {
        "etcd": ["10.0.0.1", "etcd"],
        "nats": ["10.0.0.1", "nats"],
        "frontend-0": ["10.0.0.1"],
        "w-0": ["10.0.0.1", "metrics"],  # it serves /metrics, which Prometheus checks by that name
        "w-1": ["10.0.0.2", "metrics"],
        "scraper": [],
    }
    procs = {p.name: p for p in plan.processes}
    remote = procs["w-1"]
    assert remote.env["DYN_TLS_CERT_FILE"] == f"{folder}/w-1.crt"
    assert remote.env["DYN_TLS_KEY_FILE"] == f"{folder}/w-1.key"
    assert (
        remote.env["DYN_TLS_CA_FILE"]
        == remote.env["ETCD_AUTH_CA"]
        == remote.env["NATS_TLS_CA"]
        == f"{folder}/ca.crt"
    )
    assert remote.env["DYN_ZMQ_CURVE_KEY_FILE"] == f"{folder}/curve.key"
    assert remote.env["DYN_TLS_METRICS_CA_FILE"] == f"{folder}/scrape-ca.crt"  # its /metrics' clients
    assert remote.env["ETCD_ENDPOINTS"].startswith("https://10.0.0.1:")
    assert remote.env["NATS_SERVER"].startswith("tls://10.0.0.1:")
    assert (remote.env["ETCD_AUTH_SERVER_NAME"], remote.env["NATS_TLS_SERVER_NAME"]) == ("etcd", "nats")
    # A remote process's files travel over ssh; a local one reads them where they are.
    assert set(remote.carry) == {k for k, v in remote.env.items() if v.startswith(folder)}
    assert procs["w-0"].carry == [] and procs["frontend-0"].carry == []
    etcd, nats = procs["etcd"].argv, procs["nats"].argv
    assert "--client-cert-auth" in etcd and "--peer-client-cert-auth" in etcd
    assert all(url.startswith("https://") for url in etcd[etcd.index("--listen-client-urls") + 1 :: 2][:2])
    assert nats[nats.index("--tlscacert") + 1] == f"{folder}/ca.crt" and "--tlsverify" in nats
    assert procs["etcd"].readiness.kind == "tcp"  # /health wants a client certificate


def test_one_host_auto_is_off_required_is_on_off_is_off(tmp_path: Path) -> None:
    assert _build(tmp_path, ONE_HOST).plan.tls is None
    plan = _build(tmp_path, ONE_HOST, "+security.tls=required").plan
    assert plan.tls is not None and set(plan.tls.names) == {"frontend-0", "w-0", "scraper"}
    assert _build(tmp_path, MULTI_HOST, "+security.tls=off").plan.tls is None


def test_yaml_off_is_off_and_up_warns_about_it_across_hosts(tmp_path: Path) -> None:
    built = _build(tmp_path, MULTI_HOST + "security: {tls: off}\n")  # YAML 1.1 reads `off` as false
    assert built.graph.security.tls == "off" and built.plan.tls is None
    [warning] = tls_warnings(built.graph)
    assert "security.tls is off" in warning and "gpu1" in warning
    assert tls_warnings(_build(tmp_path, MULTI_HOST).graph) == []
    assert tls_warnings(_build(tmp_path, ONE_HOST + "security: {tls: off}\n").graph) == []


def test_required_refuses_a_plaintext_listener(tmp_path: Path) -> None:
    nixl = "engine: vllm, engine_args: {kv_transfer_config: {kv_connector: NixlConnector, kv_role: kv_both}}}"
    text = ONE_HOST.replace("engine: mocker}", nixl)
    with pytest.raises(GraphError) as err:
        _build(tmp_path, text + "security: {tls: required}\n")
    assert "NIXL" in str(err.value) and "components.w.role" in str(err.value)
    assert _build(tmp_path, text).plan.tls is None  # the same graph under `auto` on one host


def test_frontend_https_compiles_to_file_paths(tmp_path: Path) -> None:
    plan = _build(
        tmp_path, ONE_HOST, "+components.frontend.http.tls={cert_file: web.crt, key_file: web.key}"
    ).plan
    frontend = next(p for p in plan.processes if p.name == "frontend-0")
    argv = frontend.argv
    assert argv[argv.index("--http-tls-cert-file") + 1] == str(tmp_path / "web.crt")
    assert argv[argv.index("--http-tls-key-file") + 1] == str(tmp_path / "web.key")
    assert frontend.readiness.target.startswith("https://127.0.0.1:")
    with pytest.raises(GraphError, match="go together"):
        _build(tmp_path, ONE_HOST, "+components.frontend.http.tls={cert_file: web.crt}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_key_material_in_any_rendering(tmp_path: Path, fmt: str) -> None:
    """Renderings name files, never contents; even with the CA made, nothing of it shows."""
    slurm = ("~hosts.gpu1.ssh", "+slurm={}") if fmt == "slurm" else ()  # hosts are the job's nodes
    built = _build(tmp_path, MULTI_HOST, *slurm)
    assert built.plan.tls is not None
    tls.issue_all(built.plan.tls.dir, built.plan.graph, built.plan.tls.names)
    out = render(built.graph, built.plan, fmt)
    secrets = [
        Path(built.plan.tls.dir, name).read_text().strip() for name in ("ca.key", "w-0.key", "curve.key")
    ]
    assert "PRIVATE KEY" not in out and "CERTIFICATE-----" not in out
    assert not any(secret in out for secret in secrets)


# ---- the agent's copies on a remote host ---------------------------------------------------------


def test_the_agent_writes_carried_files_privately_and_clears_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_run.tempfile, "gettempdir", lambda: str(tmp_path))
    tag = "dg-0123456789abcdef/w-1"
    gone = subprocess.Popen(["true"])
    gone.wait()  # an agent that was killed: its pid is free
    paths = agent_run.write_files(
        tag, {"DYN_TLS_KEY_FILE": "-----key-----\n", "DYN_TLS_CA_FILE": "ca\n"}, gone.pid
    )
    key = Path(paths["DYN_TLS_KEY_FILE"])
    assert key.read_text() == "-----key-----\n" and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert key.parent.parent == agent_run.socket_path(tag).parent  # beside the agent's socket
    # The new run of a rolling update (another agent) has its own copies, which stay.
    live = Path(
        agent_run.write_files(tag, {"DYN_TLS_KEY_FILE": "-----new-----\n"}, os.getpid())["DYN_TLS_KEY_FILE"]
    )
    assert live.parent != key.parent and live.read_text() == "-----new-----\n"
    agent_run.clear_sockets("dg-0123456789abcdef/")  # as `scan --kill` does
    assert not key.parent.exists() and live.exists()


def test_ip_sans_are_addresses(tmp_path: Path) -> None:
    tls.issue_all(tmp_path, "g", {"x": ["fd00::5", "node.example", "{addr:gpu}"]})
    ips, dns = _sans(x509.load_pem_x509_certificate((tmp_path / "x.crt").read_bytes()))
    assert ipaddress.ip_address("fd00::5") in {ipaddress.ip_address(i) for i in ips}
    assert dns == {"node.example", "localhost"}  # a Slurm placeholder is left out
    assert os.stat(tmp_path / "x.key").st_mode & 0o077 == 0


def test_with_tls_on_metrics_are_https_for_the_scraper_certificate(tmp_path: Path) -> None:
    def metrics_ports(plan) -> list[str]:  # type: ignore[no-untyped-def]
        return [name for p in plan.processes for name in p.ports if name.endswith(".metrics")]

    assert metrics_ports(_build(tmp_path, ONE_HOST).plan) == ["w-0.metrics"]  # TLS off: the default
    assert metrics_ports(_build(tmp_path, MULTI_HOST).plan) == ["w-0.metrics", "w-1.metrics"]  # TLS on too
    built = _build(
        tmp_path,
        ONE_HOST,
        "+security.tls=required",
        "components.w.metrics_port=9300",
        "+supervisor.metrics_port=9400",
    )
    plan = built.plan
    assert plan.tls is not None
    assert plan.tls.names["supervisor"] == ["127.0.0.1", "metrics"] and plan.tls.names["scraper"] == []
    folder = plan.tls.dir
    tls.issue_all(folder, plan.graph, plan.tls.names)
    scraper = x509.load_pem_x509_certificate(Path(folder, "scraper.crt").read_bytes())
    usages = scraper.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.2"}  # a client's only
    # ... of its own CA, which only /metrics listeners trust (the graph's CA did not sign it).
    scrape_ca = x509.load_pem_x509_certificate(Path(folder, "scrape-ca.crt").read_bytes())
    scraper.verify_directly_issued_by(scrape_ca)
    graph_ca = x509.load_pem_x509_certificate(Path(folder, "ca.crt").read_bytes())
    assert scraper.issuer != graph_ca.subject and scrape_ca.public_key() != graph_ca.public_key()
    worker = next(p for p in plan.processes if p.name == "w-0")
    assert worker.env["DYN_TLS_METRICS_CA_FILE"] == f"{folder}/scrape-ca.crt"
    assert stat.S_IMODE(Path(folder, "scrape-ca.key").stat().st_mode) == 0o600
    out = render(built.graph, plan, "prometheus")
    assert "PRIVATE KEY" not in out and "CERTIFICATE-----" not in out
    jobs = {job["job_name"]: job for job in yaml.safe_load(out)["scrape_configs"]}
    want = {
        "ca_file": f"{folder}/ca.crt",
        "cert_file": f"{folder}/scraper.crt",
        "key_file": f"{folder}/scraper.key",
        "server_name": "metrics",
    }
    for name in ("one-w", "one-supervisor"):
        assert jobs[name]["scheme"] == "https" and jobs[name]["tls_config"] == want, name
    assert "scheme" not in jobs["one-frontend"]  # the OpenAI-facing port: plain HTTP, as the graph says
    assert jobs["one-w"]["static_configs"][0]["targets"] == ["127.0.0.1:9300"]
