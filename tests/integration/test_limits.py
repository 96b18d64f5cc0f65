"""The frontend's limits: body size (413), concurrency (503 + Retry-After, never queued, memory
bounded), per-request timeouts (504 / an error event, the generation cancelled) and the n cap."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.metrics import metric
from tests.support.processes import ServerProcess, echo_core_args, running_server
from tests.support.waiting import wait_for

MSG = [{"role": "user", "content": "What is the capital of Tuvalu?"}]
CHAT = "/v1/chat/completions"
CAP = 4


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def capped(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Concurrency cap 4, a 16 KiB body limit, 80 ms per echoed token (a request takes ~1 s)."""
    args = echo_core_args(
        tiny_model, "tiny", "--max-concurrent-requests", str(CAP), "--http-body-limit-mb", "0.015625"
    )
    env = {"DYN_TOKEN_ECHO_DELAY_MS": "80"}
    with running_server(args, env=env, log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


def test_body_over_the_flag_limit_is_413(capped: ServerProcess) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 20_000}]}
    resp = httpx.post(f"{capped.base_url}{CHAT}", json=big, timeout=10)
    assert resp.status_code == 413
    error = resp.json()["error"]
    assert error["code"] == "body_too_large" and "16384" in error["message"]
    assert metric(capped, "dynamo_frontend_rejected_requests_total", reason="body_too_large") >= 1
    small = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    assert httpx.post(f"{capped.base_url}{CHAT}", json=small, timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "extra"),
    [(CHAT, "n", {"messages": MSG, "n": 2}), ("/v1/completions", "best_of", {"prompt": "hi", "best_of": 3})],
)
def test_choices_above_the_cap_are_400_naming_the_field(
    capped: ServerProcess, path: str, field: str, extra: dict
) -> None:
    resp = httpx.post(f"{capped.base_url}{path}", json={"model": "tiny", **extra}, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == field
    assert field in resp.json()["error"]["message"]


def test_max_tokens_above_the_context_is_400(capped: ServerProcess) -> None:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 10**9}
    resp = httpx.post(f"{capped.base_url}{CHAT}", json=body, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


async def _one(http: httpx.AsyncClient, base: str) -> tuple[int, float, dict[str, str], str]:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 12, "stream": True, "nvext": {"ignore_eos": True}}
    start = time.monotonic()
    async with http.stream("POST", f"{base}{CHAT}", json=body) as resp:
        first = time.monotonic() - start
        text = (await resp.aread()).decode()
        return resp.status_code, first, dict(resp.headers), text


async def _burst(base: str, n: int) -> list[tuple[int, float, dict[str, str], str]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        return await asyncio.wait_for(asyncio.gather(*(_one(http, base) for _ in range(n))), 120)


def test_saturation_rejects_the_excess_quickly_and_memory_stays_bounded(capped: ServerProcess) -> None:
    """10x the cap at once: about CAP requests are served in full, the rest get 503 with
    Retry-After and an OpenAI error body at once (not queued); repeated bursts leave the
    frontend's RSS where it was."""
    n = 10 * CAP
    asyncio.run(_burst(capped.base_url, n))  # warm up: connections, lazy imports, the API app
    rss_before = _rss_kb(capped.proc.pid)
    rejected_before = metric(capped, "dynamo_frontend_rejected_requests_total", reason="overloaded")
    results = []
    for _ in range(3):
        results += asyncio.run(_burst(capped.base_url, n))
    rss_after = _rss_kb(capped.proc.pid)

    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) + len(busy) == len(results), {r[0] for r in results}
    assert len(ok) >= 3 * CAP and len(busy) >= 3 * (n - 3 * CAP)
    for _, _, _, text in ok:  # accepted ones complete: one finish reason, then [DONE]
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in events if c["choices"]][-1] == "length"
        assert text.rstrip().endswith("data: [DONE]")
    for _, first, headers, text in busy:
        assert headers["retry-after"] == "1"
        assert json.loads(text)["error"]["code"] == "overloaded"
        assert first < 2.0  # answered at once; a served request takes ~1 s by itself
    rejected = metric(capped, "dynamo_frontend_rejected_requests_total", reason="overloaded")
    assert rejected - rejected_before == len(busy)
    assert metric(capped, "dynamo_frontend_admitted_requests") == 0
    assert rss_after - rss_before < 20 * 1024, (rss_before, rss_after)


SLOW_ENGINE = textwrap.dedent(
    '''
    """A pystr engine that streams a word every 0.2 s (after 10 s for the prompt "late"), and
    writes CANCEL_MARKER when its generation is cancelled."""
    import asyncio
    import os
    from pathlib import Path


    async def generate(request):
        prompt = str(request["messages"][-1].get("content") or "")
        try:
            if prompt == "late":
                await asyncio.sleep(10)
            for i in range(100):
                yield {"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}
                await asyncio.sleep(0.2)
            yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        except BaseException:
            Path(os.environ["CANCEL_MARKER"]).with_suffix("." + prompt).write_text("cancelled")
            raise
    '''
)


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("timed")
    engine = tmp / "slow_engine.py"
    engine.write_text(SLOW_ENGINE)
    marker = tmp / "cancelled"
    args = [f"out=pystr:{engine}", "--model-name", "slow", "--request-timeout-s", "1"]
    with running_server(args, env={"CANCEL_MARKER": str(marker)}, log_dir=tmp) as proc:
        yield proc, marker


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_before_the_first_byte_is_504_and_cancels(
    timed: tuple[ServerProcess, Path], stream: bool
) -> None:
    proc, marker = timed
    body = {"model": "slow", "messages": [{"role": "user", "content": "late"}], "stream": stream}
    start = time.monotonic()
    resp = httpx.post(f"{proc.base_url}{CHAT}", json=body, timeout=30)
    took = time.monotonic() - start
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "timeout"
    assert 0.9 < took < 5, took
    wait_for(marker.with_suffix(".late").exists, 5, "the engine's generation to be cancelled")
    marker.with_suffix(".late").unlink()


def test_timeout_mid_stream_is_an_error_event_and_cancels(timed: tuple[ServerProcess, Path]) -> None:
    proc, marker = timed
    body = {"model": "slow", "messages": [{"role": "user", "content": "go"}], "stream": True}
    with httpx.stream("POST", f"{proc.base_url}{CHAT}", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "timeout"
    assert 2 <= len(lines) - 2 <= 8  # a few words in ~1 s, then the error
    wait_for(marker.with_suffix(".go").exists, 5, "the engine's generation to be cancelled")
    assert metric(proc, "dynamo_frontend_rejected_requests_total", reason="timeout") >= 1
    assert metric(proc, "dynamo_frontend_admitted_requests") == 0


def test_timeout_cancels_the_generation_on_a_remote_worker(tmp_path: Path) -> None:
    """Frontend and worker in separate processes: the frontend's deadline reaches the worker's
    engine through the request plane."""
    from tests.support.processes import WorkerProcess

    engine = tmp_path / "slow_engine.py"
    engine.write_text(SLOW_ENGINE)
    marker = tmp_path / "cancelled"
    planes = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(tmp_path / "kv"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_LEASE_TTL": "2",
        "CANCEL_MARKER": str(marker),
    }
    worker = WorkerProcess.dyngraph(
        ["in=dyn://limits.slow.generate", f"out=pystr:{engine}", "--model-name", "slow"],
        env=planes,
        log_dir=tmp_path,
    )
    frontend = ServerProcess(["out=auto", "--request-timeout-s", "1"], env=planes, log_dir=tmp_path)
    try:
        frontend.wait_ready(timeout=60)  # /health: 200 once the worker's model is listed
        body = {"model": "slow", "messages": [{"role": "user", "content": "go"}], "stream": True}
        with httpx.stream("POST", f"{frontend.base_url}{CHAT}", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[-2][6:])["error"]["code"] == "timeout"
        wait_for(marker.with_suffix(".go").exists, 5, "the worker to stop generating")
    finally:
        frontend.stop()
        worker.stop()


def test_an_endless_request_head_is_cut_off_with_431(capped: ServerProcess) -> None:
    """httptools would gather a never-ending header in memory: past 64 KiB the frontend answers
    431 and closes the connection; the server goes on serving."""
    import socket

    with socket.create_connection(("127.0.0.1", capped.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-junk: ")
        reply = b""
        try:
            for _ in range(64):  # 64 x 4 KiB = 256 KiB, far past the limit
                sock.sendall(b"a" * 4096)
                time.sleep(0.005)
        except OSError:
            pass  # closed under us: expected
        sock.settimeout(5)
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b'"headers_too_large"' in reply
    ok = httpx.post(f"{capped.base_url}{CHAT}", json={"model": "tiny", "messages": MSG, "max_tokens": 1})
    assert ok.status_code == 200
