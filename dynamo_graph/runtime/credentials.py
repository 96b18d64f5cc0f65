"""Credentials and TLS for etcd and NATS, from the environment (never from graph files or flags,
so they stay out of `render`, `status`, command lines and logs).

NATS: a user/password or token in `NATS_SERVER`'s URL and the `tls://` scheme work as nats-py
reads them; in addition `NATS_CREDS` (a .creds file), `NATS_NKEY_SEED` (a seed file) and
`NATS_TLS_CA` / `NATS_TLS_CERT` / `NATS_TLS_KEY` (PEM files; the latter two for mutual TLS),
`NATS_TLS_SERVER_NAME`.

etcd, with Dynamo's variable names: `ETCD_AUTH_USERNAME` / `ETCD_AUTH_PASSWORD`, and
`ETCD_AUTH_CA` / `ETCD_AUTH_CLIENT_CERT` / `ETCD_AUTH_CLIENT_KEY` (PEM files), plus
`ETCD_AUTH_SERVER_NAME` for the TLS host name when several endpoints are given.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CredentialsError(ValueError):
    """An etcd or NATS credential or TLS file in the environment that cannot be used."""


def _env(name: str, env: Mapping[str, str] | None = None) -> str | None:
    return ((os.environ if env is None else env).get(name) or "").strip() or None


def _file(variable: str, env: Mapping[str, str] | None = None) -> Path | None:
    value = _env(variable, env)
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise CredentialsError(f"{variable}={value}: no such file")
    return path


def nats_connect_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Extra keyword arguments for `nats.connect`, from `env` (default: this process's)."""
    options: dict[str, Any] = {}
    if (creds := _file("NATS_CREDS", env)) is not None:
        options["user_credentials"] = str(creds)
    if (seed := _file("NATS_NKEY_SEED", env)) is not None:
        options["nkeys_seed"] = str(seed)
    ca, cert, key = _file("NATS_TLS_CA", env), _file("NATS_TLS_CERT", env), _file("NATS_TLS_KEY", env)
    if (cert is None) != (key is None):
        raise CredentialsError("NATS_TLS_CERT and NATS_TLS_KEY go together (mutual TLS)")
    if ca is not None or cert is not None:
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
        if cert is not None and key is not None:
            context.load_cert_chain(str(cert), str(key))
        options["tls"] = context
    if (server_name := _env("NATS_TLS_SERVER_NAME", env)) is not None:
        options["tls_hostname"] = server_name
    return options


@dataclass(frozen=True)
class EtcdCredentials:
    username: str | None = None
    password: str | None = None
    # etcd3aio's channel arguments: PEM bytes (`ca_cert` turns TLS on).
    channel: tuple[tuple[str, bytes], ...] = ()
    tls_server_name: str | None = None

    def __repr__(self) -> str:  # never print the password
        return f"EtcdCredentials(username={self.username!r}, tls={bool(self.channel)})"


def etcd_credentials(env: Mapping[str, str] | None = None) -> EtcdCredentials:
    """From `env` (a process's of a graph, for its supervisor), else this process's environment."""
    username, password = _env("ETCD_AUTH_USERNAME", env), _env("ETCD_AUTH_PASSWORD", env)
    if (username is None) != (password is None):
        raise CredentialsError("ETCD_AUTH_USERNAME and ETCD_AUTH_PASSWORD go together")
    ca, cert, key = (_file(f"ETCD_AUTH_{name}", env) for name in ("CA", "CLIENT_CERT", "CLIENT_KEY"))
    if (cert is None) != (key is None):
        raise CredentialsError("ETCD_AUTH_CLIENT_CERT and ETCD_AUTH_CLIENT_KEY go together (mutual TLS)")
    if cert is not None and ca is None:
        raise CredentialsError("ETCD_AUTH_CLIENT_CERT needs ETCD_AUTH_CA (TLS)")
    channel: list[tuple[str, bytes]] = []
    if ca is not None:
        channel.append(("ca_cert", ca.read_bytes()))
    if cert is not None and key is not None:
        channel += [("cert_chain", cert.read_bytes()), ("cert_key", key.read_bytes())]
    return EtcdCredentials(username, password, tuple(channel), _env("ETCD_AUTH_SERVER_NAME", env))
