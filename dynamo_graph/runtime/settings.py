"""The runtime's planes as `dyngraph run` flags, declared once (dynamo_graph/options.py).

None leaves the environment (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE, DYN_EVENT_PLANE, the
DYN_TLS_*_FILE and DYN_ZMQ_CURVE_KEY_FILE) in charge; a value given is written there (`to_env`),
so every part of the runtime and every child process sees one configuration, and
discovery/transport check it where they read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dynamo_graph.options import options, setting


@dataclass(frozen=True, slots=True)
class PlaneSettings:
    """Which discovery backend, request plane and event plane a process uses."""

    discovery_backend: str | None = setting(None, flag="--discovery-backend", in_graph=False)
    """file | etcd (env DYN_DISCOVERY_BACKEND)."""
    request_plane: str | None = setting(None, flag="--request-plane", in_graph=False)
    """tcp | nats (env DYN_REQUEST_PLANE)."""
    event_plane: str | None = setting(None, flag="--event-plane", in_graph=False)
    """zmq | nats | inproc (env DYN_EVENT_PLANE)."""
    tls_ca_file: str | None = setting(None, flag="--tls-ca-file", in_graph=False)
    """PEM file of the CA that signs every peer on the tcp request plane: with the two below, the
    plane is mutual TLS (env DYN_TLS_CA_FILE; a graph with `security.tls` on sets all three)."""
    tls_cert_file: str | None = setting(None, flag="--tls-cert-file", in_graph=False)
    """PEM file of this process's certificate, presented as server and as client (env
    DYN_TLS_CERT_FILE)."""
    tls_key_file: str | None = setting(None, flag="--tls-key-file", in_graph=False)
    """PEM file of this process's private key; a path, so the key never shows in `ps` (env
    DYN_TLS_KEY_FILE)."""
    zmq_curve_key_file: str | None = setting(None, flag="--zmq-curve-key-file", in_graph=False)
    """File of the graph's CURVE secret key: the zmq event plane is then encrypted and only its
    holders may connect (env DYN_ZMQ_CURVE_KEY_FILE; set with `security.tls`)."""

    def to_env(self) -> None:
        for opt in options(PlaneSettings):
            value = getattr(self, opt.name)
            if value is not None:
                os.environ[f"DYN_{opt.name.upper()}"] = value
