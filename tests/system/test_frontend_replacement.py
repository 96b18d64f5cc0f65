"""Changing a graph without a failed request (issue 25): a frontend replaced by another on its
port (SO_REUSEPORT, then a drain on SIGTERM), a worker replaced under load, and a model whose
only worker is replaced, which waits for it instead of answering 404. Real processes over the
embedded planes; the official `openai` client with no retries, one httpx client with keep-alive."""

from __future__ import annotations

import http.client
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.mocker_cluster import Cluster
from tests.support.processes import ServerProcess
from tests.support.waiting import wait_for

PID = "x-dyngraph-pid"


class Load:
    """Streamed chat completions from `threads` threads through one `openai` client (one httpx
    client, keep-alive, max_retries=0), until `total` requests or `seconds`, whichever first."""

    def __init__(
        self, base_url: str, model: str, *, threads: int = 4, total: int = 150, seconds: float = 20.0
    ):
        self.http = httpx.Client(timeout=30)
        self.client = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=self.http
        )
        self.model = model
        self.total = total
        self.seconds = seconds
        self.ok = 0
        self.failures: list[str] = []
        self._issued = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def one(self, text: str = "hello") -> str:
        stream = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": text}], max_tokens=8, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    def warm(self) -> None:
        """One request per thread at once: the pool holds that many connections afterwards."""
        with ThreadPoolExecutor(len(self._threads)) as pool:
            list(pool.map(self.one, ["warm"] * len(self._threads)))

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            with self._lock:
                if self._issued >= self.total:
                    return
                self._issued += 1
            try:
                self.one(f"request {self._issued}")
            except Exception as err:  # every failure counts, whatever it is
                with self._lock:
                    self.failures.append(repr(err))
            else:
                with self._lock:
                    self.ok += 1

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=self.seconds + 60)
        self.http.close()


def _pid_of_fresh_connection(port: int) -> int | None:
    """The pid of the frontend that a new connection to `port` reaches; None if it was refused."""
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/live", timeout=15, headers={"connection": "close"})
    except httpx.TransportError:
        return None
    return int(answer.headers[PID])


def _connection_to(port: int, pid: int) -> http.client.HTTPConnection:
    """A kept-alive connection to `port` that the frontend `pid` accepted (the kernel spreads
    new connections over the frontends sharing the port)."""
    for _ in range(200):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/live")
        answer = conn.getresponse()
        answer.read()
        if int(answer.headers[PID]) == pid:
            return conn
        conn.close()
    raise AssertionError(f"no connection to {port} reached pid {pid}")


def test_a_second_frontend_on_the_port_takes_over_without_a_failed_request(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster(workers=1, limit=None)
    old = cluster.frontend
    load = Load(old.base_url, cluster.model)
    load.warm()  # the client's pooled connections are the old frontend's
    new = ServerProcess(
        ["out=auto", "--router-mode", "round-robin"], env=cluster.env, log_dir=tmp_path, port=old.port
    )
    try:
        wait_for(lambda: _pid_of_fresh_connection(old.port) == new.proc.pid, 60, "the new frontend to answer")
        seen = {_pid_of_fresh_connection(old.port) for _ in range(40)}
        assert seen == {old.proc.pid, new.proc.pid}, seen  # both accept connections on the one port

        def new_serves_the_model() -> bool:
            conn = _connection_to(old.port, new.proc.pid)
            conn.request("GET", "/health")
            healthy = conn.getresponse().status == 200
            conn.close()
            return healthy

        wait_for(new_serves_the_model, 30, "the new frontend to list the model")
        load.start()
        wait_for(lambda: load.ok >= 30 or load.failures, 30, "requests through the old frontend")
        # Two connections the old frontend holds: one idle (its keep-alive timer, 5 s, runs from
        # now, so it is used as soon as the old one drains), one asked until it says it drains.
        kept = _connection_to(old.port, old.proc.pid)
        watch = _connection_to(old.port, old.proc.pid)
        old.proc.send_signal(signal.SIGTERM)
        at_sigterm = load.ok

        def drains() -> bool:
            watch.request("GET", "/live")
            answer = watch.getresponse()
            answer.read()
            return answer.headers["connection"] == "close"

        wait_for(drains, 10, "the old frontend to drain")
        watch.close()
        # A request on a connection it still holds is served, then the connection closes.
        kept.request("GET", "/live")
        answer = kept.getresponse()
        answer.read()
        assert answer.status == 200 and int(answer.headers[PID]) == old.proc.pid
        assert answer.headers["connection"] == "close"
        kept.close()
        # Its listener closed first: every new connection reaches the new frontend.
        wait_for(
            lambda: all(_pid_of_fresh_connection(old.port) == new.proc.pid for _ in range(20)),
            10,
            "the old frontend's listener to close",
        )
        load.join()
        assert load.failures == [], load.failures
        assert load.ok > at_sigterm, "no request ran after the SIGTERM"
        assert old.proc.wait(timeout=40) == 0, old.log()
        assert _pid_of_fresh_connection(old.port) == new.proc.pid
    finally:
        new.stop()


def test_a_worker_replaced_under_load_fails_no_request(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(workers=1, limit=None)
    first = cluster.workers[0]
    cluster.start_worker()
    cluster.wait_routable(2)
    load = Load(cluster.frontend.base_url, cluster.model).start()
    wait_for(lambda: load.ok >= 30 or load.failures, 30, "requests to both workers")
    first.proc.send_signal(signal.SIGTERM)  # it unregisters, then drains its streams
    at_sigterm = load.ok
    load.join()
    assert load.failures == [], load.failures
    assert load.ok > at_sigterm, "no request ran after the SIGTERM"
    assert first.proc.wait(timeout=30) == 0, first.log()
    cluster.workers.remove(first)
    cluster.retired.append(first)


def _models(cluster: Cluster) -> list[str]:
    return [m["id"] for m in httpx.get(f"{cluster.frontend.base_url}/v1/models", timeout=5).json()["data"]]


def test_a_model_without_workers_waits_for_one_then_answers_503_not_404(
    make_cluster: Callable[..., Cluster],
) -> None:
    wait_s = 20.0
    cluster = make_cluster(workers=1, limit=None, frontend_args=["--model-wait-s", f"{wait_s:g}"])
    load = Load(cluster.frontend.base_url, cluster.model)

    def stop_the_worker() -> None:
        assert cluster.workers[0].stop() == 0
        cluster.retired.append(cluster.workers.pop(0))
        wait_for(lambda: not cluster.routable(), 10, "the worker to leave routing")
        assert _models(cluster) == [cluster.model]  # still listed: it waits for a worker

    # Its only worker replaced: requests made in between wait for the new one.
    stop_the_worker()
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(load.one, f"waiting {i}") for i in range(3)]
        time.sleep(0.5)
        assert not any(f.done() for f in waiting)
        cluster.start_worker()
        assert all(f.result(timeout=wait_s + 10) for f in waiting)

    # No worker comes back: 503 with Retry-After past the wait, never 404; then the model leaves.
    stop_the_worker()
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        load.one("nobody serves this")
    assert time.monotonic() - started >= 1.0  # it waited
    assert err.value.status_code == 503, err.value
    assert err.value.response.headers["retry-after"]
    assert err.value.body["code"] == "model_unavailable"  # type: ignore[index]
    wait_for(lambda: cluster.model not in _models(cluster), wait_s + 5, "the model to leave /v1/models")
    with pytest.raises(openai.NotFoundError):
        load.one("gone")
    load.http.close()
