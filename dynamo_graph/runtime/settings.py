"""The runtime's planes and its tracing as `dyngraph run` flags, declared once
(dynamo_graph/options.py).

None leaves the environment (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE, DYN_EVENT_PLANE, the
DYN_TLS_*_FILE and DYN_ZMQ_CURVE_KEY_FILE; the OpenTelemetry SDK's OTEL_*) in charge; a value
given is written there (`to_env`), so every part of the runtime and every child process sees one
configuration, and discovery/transport/tracing check it where they read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dynamo_graph.options import SettingError, Spell, options, setting


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
    tls_metrics_ca_file: str | None = setting(None, flag="--tls-metrics-ca-file", in_graph=False)
    """PEM file of the CA whose certificates may read this process's `/metrics` over TLS (env
    DYN_TLS_METRICS_CA_FILE; a graph sets its scraper's CA); default: the plane's CA."""
    zmq_curve_key_file: str | None = setting(None, flag="--zmq-curve-key-file", in_graph=False)
    """File of the graph's CURVE secret key: the zmq event plane is then encrypted and only its
    holders may connect (env DYN_ZMQ_CURVE_KEY_FILE; set with `security.tls`)."""

    def to_env(self) -> None:
        for opt in options(PlaneSettings):
            value = getattr(self, opt.name)
            if value is not None:
                os.environ[f"DYN_{opt.name.upper()}"] = value


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where a process sends its OpenTelemetry traces, as the SDK's own OTEL_* variables."""

    otlp_endpoint: str | None = setting(None, flag="--otlp-endpoint")
    """OTLP/HTTP endpoint of a collector, e.g. `http://collector:4318`; set, every frontend and
    worker traces its requests there (OTEL_EXPORTER_OTLP_ENDPOINT)."""
    sample_ratio: float = setting(1.0, flag="--trace-sample-ratio", ge=0, le=1)
    """Share of the traces the frontend starts that are kept; a client's `traceparent` that is
    sampled is always followed (parent-based sampling: OTEL_TRACES_SAMPLER,
    OTEL_TRACES_SAMPLER_ARG)."""

    def check(self, given: set[str], spell: Spell) -> None:
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise SettingError(
                f"{spell('otlp_endpoint')}: expected an http:// or https:// URL of an OTLP/HTTP "
                f"endpoint, not {self.otlp_endpoint!r}"
            )

    def otel_env(self, given: set[str]) -> dict[str, str]:
        """The SDK's variables for the settings in `given` (an endpoint of None: none)."""
        env: dict[str, str] = {}
        if self.otlp_endpoint is not None and "otlp_endpoint" in given:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.otlp_endpoint
            env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
        if "sample_ratio" in given:
            env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
            env["OTEL_TRACES_SAMPLER_ARG"] = f"{self.sample_ratio:g}"
        return env

    def to_env(self, given: set[str]) -> None:
        """Write the settings given on the command line over the environment's OTEL_*."""
        os.environ.update(self.otel_env(given))
