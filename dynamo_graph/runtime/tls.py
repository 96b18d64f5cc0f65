"""Mutual TLS for the tcp request plane, from three PEM files named in the environment.

DYN_TLS_CA_FILE, DYN_TLS_CERT_FILE and DYN_TLS_KEY_FILE (runtime/settings.py declares them as
`dyngraph run` flags; a graph with `security.tls` on sets them for every process) go together:
all three turn the plane into TLS 1.3 with a certificate required of both ends, verified against
the one CA; none leaves it plain TCP. Only paths travel in the environment, never key material.

Trust is membership: the CA signs the processes of one graph and nothing else (graph/tls.py
issues them), any member may serve or call any endpoint, so peers are checked against the CA
and not by host name (a worker that binds a wildcard address advertises a name no certificate
could list in advance).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

ENV_CA, ENV_CERT, ENV_KEY = "DYN_TLS_CA_FILE", "DYN_TLS_CERT_FILE", "DYN_TLS_KEY_FILE"
ENV_METRICS_CA = "DYN_TLS_METRICS_CA_FILE"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of one process: the graph's CA, its certificate and its private key."""

    ca: str
    cert: str
    key: str

    @classmethod
    def from_env(cls) -> TlsFiles | None:
        """The files the environment names; None when it names none. ValueError when it names
        some but not all, or a file that is not there."""
        given = {name: (os.environ.get(name) or "").strip() for name in (ENV_CA, ENV_CERT, ENV_KEY)}
        if not any(given.values()):
            return None
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise ValueError(f"{', '.join(missing)} unset: {ENV_CA}, {ENV_CERT} and {ENV_KEY} go together")
        for name, value in given.items():
            if not Path(value).is_file():
                raise ValueError(f"{name}={value}: no such file")
        return cls(given[ENV_CA], given[ENV_CERT], given[ENV_KEY])

    @classmethod
    def for_metrics(cls) -> TlsFiles | None:
        """A `/metrics` listener's files: the process's certificate, with its clients checked
        against DYN_TLS_METRICS_CA_FILE (a graph's scraper CA, which no other listener trusts)
        where that is set, else against the plane's CA."""
        files = cls.from_env()
        metrics_ca = (os.environ.get(ENV_METRICS_CA) or "").strip()
        if files is None or not metrics_ca:
            return files
        if not Path(metrics_ca).is_file():
            raise ValueError(f"{ENV_METRICS_CA}={metrics_ca}: no such file")
        return cls(metrics_ca, files.cert, files.key)

    def _context(self, purpose: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(purpose)
        ctx.check_hostname = False
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are ours: no older protocol to allow
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """A listener's context: a peer without a certificate of the graph's CA is refused."""
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        """A caller's context: the server must show a certificate of the graph's CA (see the
        module docstring for why no host name is checked)."""
        return self._context(ssl.PROTOCOL_TLS_CLIENT)


def check_settings() -> None:
    """Raise ValueError now for an incomplete or wrong TLS setting (before connecting)."""
    files = TlsFiles.from_env()
    if files is not None:
        try:
            files.server_context()
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{ENV_CERT} / {ENV_KEY} / {ENV_CA}: cannot load: {exc}") from None
