"""A frontend with `replicas: 2` (issue 27): two processes on one port (SO_REUSEPORT), each with
its own KV router fed by the same KV events. `dyngraph up` of the CI graph mocker-kv.yaml (two
mocker workers, kv routing) on real processes; the official `openai` client, a new connection per
request unless a test pins one; which process answered is its `x-dyngraph-pid` header."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.local_graph import Graph
from tests.support.processes import (
    DYNGRAPH,
    ServerProcess,
    WorkerProcess,
    embedded_planes_env,
    pid_alive,
    port_refuses,
)
from tests.support.rolling_load import StreamingLoad
from tests.support.routing import opening_messages
from tests.support.waiting import wait_for

PID = "x-dyngraph-pid"
MODEL = "tiny-model"


@pytest.fixture
def graph(tmp_path: Path, tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[Graph]:
    """mocker-kv.yaml up with `replicas: 2` on its frontend (and the test's own overrides)."""
    graph = Graph("mocker-kv.yaml", tmp_path, tiny_model)
    try:
        up = graph.up("+components.frontend.replicas=2", *getattr(request, "param", ()))
        assert up.returncode == 0, up.stdout + up.stderr
        yield graph
    finally:
        graph.cli("down", timeout=90)


def _client(graph: Graph, *, keep_alive: bool = False) -> openai.OpenAI:
    """No retries; without keep-alive every request opens a new connection (any process may take it)."""
    limits = httpx.Limits(max_keepalive_connections=None if keep_alive else 0)
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{graph.port}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(timeout=30, limits=limits),
    )


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8) -> tuple[int, dict]:
    """(the pid of the process that answered, the answer)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens
    )
    return int(raw.headers[PID]), raw.parse().model_dump()


def _frontend_pids(graph: Graph) -> dict[str, int]:
    return {name: r["pid"] for name, r in graph.processes().items() if r["component"] == "frontend"}


def test_both_processes_serve_one_port_and_one_scrape_counts_both(graph: Graph) -> None:
    pids = _frontend_pids(graph)
    assert sorted(pids) == ["frontend-0", "frontend-1"], pids
    status = graph.cli("status")
    assert "frontend-0" in status.stdout and "frontend-1" in status.stdout, status.stdout
    client = _client(graph)
    answered: dict[int, int] = {}
    for n in range(40):
        pid, body = _chat(client, [{"role": "user", "content": f"hello {n}"}])
        assert body["choices"][0]["finish_reason"] == "length"
        answered[pid] = answered.get(pid, 0) + 1
        if len(answered) == 2 and n >= 9:
            break
    assert set(answered) == set(pids.values()), (answered, pids)
    metrics = httpx.get(f"http://127.0.0.1:{graph.port}/metrics", timeout=10).text
    assert "dynamo_frontend_group_processes 2.0" in metrics
    for pid, count in answered.items():
        line = (
            f'dynamo_frontend_requests_total{{endpoint="chat_completions",model="{MODEL}",pid="{pid}",'
            f'request_type="unary",status="success"}} {float(count)}'
        )
        assert line in metrics, metrics


# Dynamo's block cost: a cached prefix always wins between idle workers. The default predictive
# cost weighs it against each worker's TTFT fit, which each process fits from its own requests:
# with the mocker at speedup 10 on a loaded machine a 9-block prefix saves ~0.2 ms against fits
# that differ by tens of ms, so it tests the fits' noise (docs/frontend-scaling.md), not the index.
@pytest.mark.parametrize("graph", [["+components.frontend.router.cost=dynamo"]], indirect=True)
def test_follow_up_turns_through_either_process_find_the_prefix_holder(graph: Graph) -> None:
    """Each conversation's first turn lands on one process; its follow-ups are sent until one
    lands on the other, and every one is routed to the worker caching the conversation (the
    mocker reports the cached prompt tokens). A router that did not hear the other process's
    conversations would pick by load: half of them on the wrong worker. And both processes'
    indexes of the workers' caches end up the same size: they applied the same KV events."""
    client = _client(graph)
    crossed = 0
    for conv in range(6):
        messages = opening_messages(conv)
        first_pid, first = _chat(client, messages, max_tokens=24)
        messages.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": "Follow-up: can you check again?"})
        for _ in range(16):
            pid, body = _chat(client, messages)
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            # Everything up to the first turn's answer is cached there (whole 16-token blocks).
            assert cached >= first["usage"]["prompt_tokens"] - 16, (conv, pid, first_pid, body["usage"])
            if pid != first_pid:
                crossed += 1
                break
    assert crossed == 6, f"only {crossed} of 6 conversations reached the other process"
    # Both workers held conversations (on one alone, any router would have found the prefix).
    served = _requests_per_worker(graph)
    assert len(served) == 2 and all(served.values()), served

    def indexed() -> dict[str, float]:
        metrics = httpx.get(f"http://127.0.0.1:{graph.port}/metrics", timeout=10).text
        return {
            s.labels["pid"]: s.value
            for f in text_string_to_metric_families(metrics)
            for s in f.samples
            if s.name == "dynamo_frontend_router_indexed_blocks"
        }

    wait_for(lambda: len(set(indexed().values())) == 1 and len(indexed()) == 2, 10, "the same index")
    assert next(iter(indexed().values())) > 0


def _requests_per_worker(graph: Graph) -> dict[str, int]:
    """Requests per worker instance, summed over both processes' /health (each counts its own)."""
    seen: dict[str, dict[str, int]] = {}
    for _ in range(40):
        resp = httpx.get(f"http://127.0.0.1:{graph.port}/health", timeout=10)  # a new connection
        instances = resp.json()["details"][MODEL]["instances"]
        seen[resp.headers[PID]] = {i["instance_id"]: i["requests"] for i in instances}
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    total: dict[str, int] = {}
    for counts in seen.values():
        for instance, n in counts.items():
            total[instance] = total.get(instance, 0) + n
    return total


def test_a_killed_process_loses_no_request_of_the_other_and_comes_back(graph: Graph) -> None:
    # One kept-alive connection, so every request goes to its process (unary: a streamed answer
    # that the openai client stops reading at [DONE] closes its connection).
    pinned = _client(graph, keep_alive=True)
    survivor, _ = _chat(pinned, [{"role": "user", "content": "pin"}])
    pids = _frontend_pids(graph)
    victim_name, victim = next((n, p) for n, p in pids.items() if p != survivor)
    failures: list[str] = []
    served = 0
    done = threading.Event()

    def load() -> None:
        nonlocal served
        while not done.is_set():
            try:
                pid, body = _chat(pinned, [{"role": "user", "content": f"pinned {served}"}], max_tokens=16)
                assert pid == survivor and body["usage"]["completion_tokens"] == 16, (pid, body)
                served += 1
            except Exception as err:  # every failure counts
                failures.append(repr(err))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    wait_for(lambda: served >= 5, 30, "streams through the survivor")
    os.kill(victim, signal.SIGKILL)
    # Once it is gone its listener is too (until then a connection queued there is reset: the
    # kernel's race, not the frontend's).
    wait_for(lambda: not pid_alive(victim), 10, "the killed process gone")
    fresh = _client(graph)
    after_kill = [_chat(fresh, [{"role": "user", "content": f"after {n}"}])[0] for n in range(10)]
    assert set(after_kill) == {survivor}  # new connections: only the survivor listens

    def restarted() -> bool:
        record = graph.processes()[victim_name]
        return record["state"] == "ready" and record["pid"] not in (None, victim) and record["restarts"] == 1

    wait_for(restarted, 60, f"{victim_name} restarted")
    before = served
    wait_for(lambda: served >= before + 5, 30, "more streams through the survivor")
    done.set()
    thread.join(30)
    assert failures == [] and served > 10, (failures, served)
    comeback = graph.processes()[victim_name]["pid"]
    status = graph.cli("status").stdout
    row = next(line for line in status.splitlines() if victim_name in line)
    cells = [c.strip() for c in row.replace("│", "|").split("|") if c.strip()]
    assert cells[:5] == [victim_name, "local", str(comeback), "ready", "1"], status
    seen = {_chat(fresh, [{"role": "user", "content": f"back {n}"}])[0] for n in range(40)}
    assert comeback in seen, (seen, comeback)


def test_rolling_and_scaling_replicated_frontends_fail_nothing(graph: Graph) -> None:
    """A changed frontend's replicas are replaced one at a time, each new process beside its
    old one on the port; scaling to 3 adds one, back to 1 retires two. Streamed load throughout."""
    url = f"http://127.0.0.1:{graph.port}/v1"
    with StreamingLoad(url, MODEL) as load:
        load.wait_for_requests(20)
        before = _frontend_pids(graph)
        rolled = graph.up("+components.frontend.replicas=2", "+components.frontend.limits.model_wait_s=20")
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        assert "~ frontend-0" in rolled.stdout and "~ frontend-1" in rolled.stdout, rolled.stdout
        after = _frontend_pids(graph)
        assert set(after) == set(before) and not set(after.values()) & set(before.values()), (before, after)
        load.wait_for_requests(20)
        grown = graph.up("+components.frontend.replicas=3", "+components.frontend.limits.model_wait_s=20")
        assert grown.returncode == 0 and "+ frontend-2" in grown.stdout, grown.stdout + grown.stderr
        assert _frontend_pids(graph)["frontend-1"] == after["frontend-1"]  # untouched
        load.wait_for_requests(20)
        shrunk = graph.up("+components.frontend.limits.model_wait_s=20")  # replicas: 1
        assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
        assert "- frontend-1" in shrunk.stdout and "- frontend-2" in shrunk.stdout, shrunk.stdout
        assert sorted(_frontend_pids(graph)) == ["frontend-0"]
        load.wait_for_requests(20)
    result = load.result
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"


def _children(pid: int) -> set[int]:
    return {int(c) for task in Path(f"/proc/{pid}/task").glob("*/children") for c in task.read_text().split()}


def test_dyngraph_run_http_processes_keeps_its_processes_running(tmp_path: Path, tiny_model: Path) -> None:
    """`dyngraph run in=http --http-processes 2`: both serve the port, one killed comes back, and
    SIGTERM to the group ends them all; so does a kill -9 of the group (no orphan keeps the port)."""
    planes = embedded_planes_env(tmp_path, zmq_events=True)
    argv = [*DYNGRAPH, "run", "in=dyn://run.mocker.generate", "out=mocker", str(tiny_model)]
    worker = WorkerProcess(argv, env=planes, log_dir=tmp_path)
    groups = [ServerProcess(["out=auto", "--http-processes", "2"], env=planes, log_dir=tmp_path)]
    try:
        group = groups[0]
        group.wait_ready()

        def answering() -> set[int]:
            return {int(httpx.get(f"{group.base_url}/health", timeout=5).headers[PID]) for _ in range(20)}

        first = _children(group.proc.pid)
        assert len(first) == 2
        wait_for(lambda: answering() == first, 30, "both processes answering")
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(_children(group.proc.pid) - first) == 1, 30, "a new process")
        wait_for(lambda: answering() == _children(group.proc.pid), 30, "the new process answering")
        ended = first | _children(group.proc.pid)
        assert group.stop() == 0, group.log()
        assert not any(pid_alive(p) for p in ended) and port_refuses(group.port), group.log()

        groups.append(ServerProcess(["out=auto", "--http-processes", "2"], env=planes, log_dir=tmp_path))
        killed = groups[-1]
        killed.wait_ready()
        wait_for(lambda: len(_children(killed.proc.pid)) == 2, 30, "two processes")
        orphans = _children(killed.proc.pid)
        killed.proc.kill()
        wait_for(lambda: not any(pid_alive(p) for p in orphans), 30, "its processes ended with it")
    finally:
        for group in groups:
            group.stop()
        worker.stop()
