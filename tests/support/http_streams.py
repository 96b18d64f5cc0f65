"""Streams a client abandons, and what the frontend counts of them: the cancellation tests of
each API surface (chat completions, responses, anthropic messages) share these."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.metrics import metric
from tests.support.processes import ServerProcess
from tests.support.waiting import wait_for


def paced_server(tiny_model: Path, tmp_path: Path, delay_ms: int) -> ServerProcess:
    """A ready echo server that sends a token every `delay_ms`, so a stream can be cut mid-way."""
    proc = ServerProcess(
        ["out=echo_core", "--model-path", str(tiny_model)],
        env={"DYN_TOKEN_ECHO_DELAY_MS": str(delay_ms)},
        log_dir=tmp_path,
    )
    proc.wait_ready()
    return proc


def abandon_stream(server: ServerProcess, path: str, body: dict, marker: str) -> None:
    """Start a stream and hang up as soon as a line containing `marker` arrives."""
    with httpx.Client(timeout=10) as http, http.stream("POST", f"{server.base_url}{path}", json=body) as resp:
        for line in resp.iter_lines():
            if marker in line:
                return
    raise AssertionError(f"the stream of {path} ended without a line containing {marker!r}")


def cancelled_streams(server: ServerProcess, endpoint: str, model: str, within_s: float = 1.5) -> float:
    """Streams of `endpoint` the frontend counted as cancelled, once it counts one (within `within_s`)."""
    labels = {"endpoint": endpoint, "model": model, "request_type": "stream", "status": "cancelled"}

    def count() -> float:
        return metric(server, "dynamo_frontend_requests_total", **labels)

    wait_for(count, within_s, f"a cancelled {endpoint} stream to be counted")
    return count()
