"""The graph's certificate authority: one CA per graph and a certificate per process, for
`security.tls` (docs/security.md "TLS").

Everything lives in the graph's state dir, `<state>/tls/` (a folder only the user can enter,
every file 0600): `ca.crt` / `ca.key`, `<process>.crt` / `<process>.key` for each process of
the plan, `scrape-ca.crt` / `.key` and `scraper.crt` / `.key` (below), and `curve.key`, the
graph's CURVE key for the zmq event plane. The plan names these paths (compile.py), never their
contents; the ssh launcher carries the files a remote process
needs over its ssh channel (remote/agent_run.py writes them there, also 0600).

Rotation: every `up` that applies a new revision issues every process a new key and
certificate (`issue_all`); a process loads its files when it starts, so a process that keeps
running keeps the ones it has, and each new or restarted one gets fresh ones. The CA is kept for
the life of the state dir, because processes of the old and the new revision must trust each
other during a rolling update; it is replaced only when it is missing or has less than
`CA_RENEW_DAYS` left at a first `up` (on a running graph the supervisor keeps it and says so in
its log: every process must trust a new CA at once, so that takes `down` and `up`). Leaf
certificates never outlive their CA.

Managed etcd and nats-server are also issued for the names `etcd` and `nats`, which
their clients are told to expect: whatever address they are dialled at (a Slurm node's is only
known in the job), a client checks that it reached the graph's etcd, not just a member.

Every process that serves `/metrics` (workers, the supervisor) serves it over TLS with its own
certificate, which also holds the name `metrics`, checked by the Prometheus configuration
(`render -f prometheus`) whatever address it scrapes. Prometheus gets `scraper.crt` /
`scraper.key`, a client-only certificate of a CA of its own, `scrape-ca.crt`, which the
`/metrics` listeners (and only they) trust for their clients: the scraper's key reads metrics,
but no other listener of the graph (request plane, etcd, nats) takes it for a member's.

Keys are ECDSA P-256: a TLS 1.3 handshake with them costs a fraction of an RSA one's CPU.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import zmq
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 365
CA_RENEW_DAYS = 30  # a CA with less left than this is replaced at the next `up`
LEAF_DAYS = 90
LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")  # every process may be dialled on its own host
METRICS_NAME = "metrics"  # held by the certificate of every process serving /metrics
SCRAPER = "scraper"  # Prometheus's client certificate
SCRAPE_CA = "scrape-ca"  # the CA of the scraper alone, trusted by /metrics listeners only
SUPERVISOR = "supervisor"  # the supervisor's, for its own /metrics


def tls_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "tls"


def ca_file(folder: str | Path, stem: str = "ca") -> str:
    """The CA's certificate: the graph's (`ca`), or the scraper's (`SCRAPE_CA`)."""
    return str(Path(folder) / f"{stem}.crt")


def curve_file(folder: str | Path) -> str:
    """The graph's CURVE secret key (the zmq event plane's, runtime/events/curve.py): made and
    replaced with the CA."""
    return str(Path(folder) / "curve.key")


def cert_files(folder: str | Path, process: str) -> tuple[str, str]:
    """(certificate, private key) of one process."""
    return str(Path(folder) / f"{process}.crt"), str(Path(folder) / f"{process}.key")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to a new file that only the user can read (0600 from its creation, so the
    key is never readable by others for an instant), then move it in place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _private_folder(folder: Path) -> None:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _sans(names: Iterable[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in dict.fromkeys([*names, *LOOPBACK_NAMES]):  # ordered, no repeats
        if "{" in name:
            continue  # a Slurm node's address, known only in the job: peers check the CA, not names
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


class CertificateAuthority:
    """The CA of one graph's state dir: loaded if it is there and not due for renewal, else new."""

    def __init__(self, folder: str | Path, graph: str, *, renew: bool = True, stem: str = "ca") -> None:
        """`renew`: replace a CA that is due (only where no process of the graph runs, which
        trusts the old one); else keep it while it is valid. `stem`: its files' (`SCRAPE_CA`:
        the scraper's CA, which has no CURVE key beside it)."""
        self.folder = Path(folder)
        self.graph = graph
        self.stem = stem
        _private_folder(self.folder)
        self.renewed = False
        loaded = self._load()
        if loaded is None or (renew and self._due(loaded[0])):
            loaded = self._create()
            self.renewed = True
        self.cert, self.key = loaded
        if stem == "ca" and (self.renewed or not Path(curve_file(self.folder)).exists()):
            _write_private(Path(curve_file(self.folder)), zmq.curve_keypair()[1] + b"\n")

    @staticmethod
    def _due(cert: x509.Certificate) -> bool:
        return cert.not_valid_after_utc - _now() < datetime.timedelta(days=CA_RENEW_DAYS)

    def _load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
        try:
            cert = x509.load_pem_x509_certificate((self.folder / f"{self.stem}.crt").read_bytes())
            key = serialization.load_pem_private_key((self.folder / f"{self.stem}.key").read_bytes(), None)
        except (OSError, ValueError):
            return None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.not_valid_after_utc <= _now():
            return None
        return cert, key

    def _create(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        what = "CA" if self.stem == "ca" else self.stem
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dyngraph {what} {self.graph}")])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        _write_private(self.folder / f"{self.stem}.key", _key_pem(key))
        _write_private(self.folder / f"{self.stem}.crt", cert.public_bytes(serialization.Encoding.PEM))
        return cert, key

    def issue(self, process: str, names: Iterable[str], *, server: bool = True) -> tuple[str, str]:
        """A new key and certificate for `process`, valid for `names` (its host's addresses; the
        loopback names always), for both ends of a connection (only the client's without
        `server`); returns their paths."""
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{self.graph}/{process}")]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=LEAF_DAYS), self.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_sans(names)), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([*usages, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path, key_path = cert_files(self.folder, process)
        _write_private(Path(key_path), _key_pem(key))
        _write_private(Path(cert_path), cert.public_bytes(serialization.Encoding.PEM))
        return cert_path, key_path

    def days_left(self) -> float:
        return (self.cert.not_valid_after_utc - _now()).total_seconds() / 86400


def issue_all(
    folder: str | Path, graph: str, names: dict[str, list[str]], *, renew: bool = True
) -> CertificateAuthority:
    """Issue every process in `names` (process -> the names its certificate holds) a new
    certificate under the graph's CA, made first if it is missing (or due, with `renew`); the
    scraper's, for a client only, under the scraper's own CA."""
    ca = CertificateAuthority(folder, graph, renew=renew)
    for process, addresses in sorted(names.items()):
        if process == SCRAPER:
            CertificateAuthority(folder, graph, renew=renew, stem=SCRAPE_CA).issue(process, [], server=False)
        else:
            ca.issue(process, addresses)
    return ca


if (
    __name__ == "__main__"
):  # `render -f shell`'s scripts: python -m dynamo_graph.graph.tls DIR GRAPH NAMES_JSON
    issue_all(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
