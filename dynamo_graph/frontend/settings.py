"""The frontend's settings, declared once (dynamo_graph/options.py derives the rest from them):
where it listens, its API keys, what it lets requests use, and what it records. A graph
frontend's `http:`, `limits:` and `record:` sections are built from the same fields
(graph/sections.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dynamo_graph.options import SettingError, Spell, setting

GROUP_ENV = "DYN_FRONTEND_GROUP"
"""Set (to the group's name) in each of the frontend processes that share one port: they answer
/metrics for the whole group (frontend/group.py). `dyngraph run --http-processes` sets it for
its children, a graph's compiler for the replicas of a frontend."""


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Where the OpenAI-compatible HTTP server listens."""

    host: str = setting("127.0.0.1", flag="--http-host")
    """Bind address; `0.0.0.0` to serve other machines."""
    port: int = setting(8080, flag="--http-port", ge=0, le=65535)
    """Port."""
    processes: int = setting(1, flag="--http-processes", ge=1, le=256, in_graph=False)
    """Frontend processes sharing the port (SO_REUSEPORT), each with its own router fed by the
    same KV events and load reports, restarted if one dies (vLLM's `--api-server-count`, uvicorn's
    `--workers`; a graph's frontend says `replicas`). Needs a fixed port and workers it
    discovers (out=auto or dyn://); see docs/frontend-scaling.md."""
    stream_interval: int = setting(1, flag="--stream-interval", ge=1, le=4096)
    """Tokens per streamed SSE event after the first, as vLLM's and SGLang's flag: the first
    token goes out at once, then an event every N tokens; the last tokens, the finish reason and
    usage go out together. 1 sends every token as its own event; more saves CPU in the frontend
    and the client for burstier streams (docs/frontend-scaling.md)."""
    api_key: str | None = setting(None, flag="--api-key", in_graph=False)
    """Require this key (a comma list for several) on /v1 routes; DYN_API_KEY keeps it out of
    `ps`, DYN_API_KEY_ENV names variables that hold keys."""

    def check(self, given: set[str], spell: Spell) -> None:
        if self.processes > 1 and self.port == 0:
            raise SettingError(f"{spell('processes')} needs a fixed {spell('port')}: the processes share it")
        if self.api_key is not None and not [k for k in self.api_key.split(",") if k.strip()]:
            raise SettingError(
                f"{spell('api_key')} needs a key (or a comma list of keys)"
            )  # never echo a key


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """API keys with tenants (frontend/tenants.py, docs/security.md)."""

    keys_file: str | None = setting(None, flag="--api-keys-file")
    """YAML file of tenants' API keys (by sha256), allowed models, limits and cache groups;
    reloaded when it changes and on SIGHUP. Works beside `--api-key` / `api_key_env`."""

    def check(self, given: set[str], spell: Spell) -> None:
        if self.keys_file is not None and not self.keys_file.strip():
            raise SettingError(f"{spell('keys_file')} needs the path of a keys file")


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """What the frontend lets requests use; past a limit a client gets an OpenAI error body."""

    max_concurrent_requests: int = setting(1024, flag="--max-concurrent-requests", ge=0)
    """Generation requests in flight at once; more are answered 503 with `Retry-After` at once,
    never queued (0 = unlimited)."""
    request_timeout_s: float | None = setting(None, flag="--request-timeout-s", gt=0)
    """Cancel a request's generation after this many seconds: 504, or an error event
    mid-stream; default none."""
    body_limit_mb: float | None = setting(None, flag="--http-body-limit-mb", gt=0)
    """Largest request body in MiB; larger is 413; default DYN_HTTP_BODY_LIMIT_MB, else 32."""
    health_check_interval_s: float | None = setting(None, flag="--health-check-interval-s", ge=0)
    """Probe a worker instance that has been silent this long (default
    DYN_HEALTH_CHECK_INTERVAL_S, else 5; 0 = no health checks)."""
    health_check_timeout_s: float | None = setting(None, flag="--health-check-timeout-s", gt=0)
    """A probe not answered within this takes the instance out of routing until one passes
    (default DYN_HEALTH_CHECK_TIMEOUT_S, else 3)."""
    unknown_fields: Literal["reject", "ignore"] = setting("reject", flag="--http-unknown-fields")
    """A request naming a field its API does not have (a misspelled `maxtokens`): `reject` answers
    400 naming it, as OpenAI does; `ignore` serves it without, for clients that send vendor extras
    this server does not know. Only the request's top level is checked (docs/http-api.md)."""
    model_wait_s: float = setting(30.0, flag="--model-wait-s", ge=0)
    """A served model whose workers are all gone (being replaced, restarting) stays listed this
    long: its requests wait for a worker, then get 503 with `Retry-After`, never 404 (0 = drop it
    at once)."""


@dataclass(frozen=True, slots=True)
class RecordSettings:
    """Recording the requests a frontend serves as a trace `dyngraph bench --trace` replays."""

    path: str | None = setting(None, flag="--record")
    """Append each request served to this file, one mooncake-format line (timestamp, input and
    output lengths, prefix block hash ids) plus model and session (docs/observability.md)."""
    record_text: bool = setting(False, flag="--record-text")
    """Also record the request's messages or prompt (user data: off by default)."""
    block_size: int = setting(512, flag="--record-block-size", ge=1)
    """Prompt tokens per hash id (the mooncake traces' 512; replay with the same
    `--trace-block-size`)."""

    def check(self, given: set[str], spell: Spell) -> None:
        extra = [spell(name) for name in ("record_text", "block_size") if name in given]
        if extra and self.path is None:
            raise SettingError(f"{', '.join(extra)}: shape the recording, which needs {spell('path')}")


@dataclass(frozen=True, slots=True)
class HttpTlsSettings:
    """HTTPS on the frontend's port (a graph frontend's `http.tls`): both files, or neither for
    plain HTTP. Paths only: the key stays in its file, out of `ps` and `render`."""

    cert_file: str | None = setting(None, flag="--http-tls-cert-file", dynamo="--tls-cert-path")
    """PEM file of the server's certificate (its chain after it)."""
    key_file: str | None = setting(None, flag="--http-tls-key-file", dynamo="--tls-key-path")
    """PEM file of the certificate's private key."""

    def check(self, given: set[str], spell: Spell) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise SettingError(f"{spell('cert_file')} and {spell('key_file')} go together (HTTPS)")
