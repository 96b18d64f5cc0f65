"""Running one check of a graph that is up: a request (repeated), `/v1/models`, `/metrics`, or a
fault. Each returns a CheckResult; an HTTP error or a timeout is a failure of that check, never
of the run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import httpx

from dynamo_graph.graph.metric_expr import parse_metric_expr
from dynamo_graph.graph.schema import Expect, Graph, SmokeCheck, SmokeFault
from dynamo_graph.graph.targets.local.runner import Runner
from dynamo_graph.graph.targets.local.supervisor import Supervisor
from dynamo_graph.smoke.client import Answer, send
from dynamo_graph.smoke.defaults import served_models
from dynamo_graph.smoke.expect import unmet
from dynamo_graph.smoke.results import CheckResult

METRICS_SETTLE_S = 5.0  # counters of a request that just ended may show a moment later
MODELS_TIMEOUT_S = 60.0  # once the graph is up, until its frontends list their models
POLL_S = 0.05


@dataclass(frozen=True)
class Address:
    """Where a frontend listens (`http://host:port`) and the headers it wants (an API key)."""

    url: str
    headers: dict[str, str]


@dataclass
class Target:
    """What the checks talk to: the graph, its supervisor, each frontend's address."""

    graph: Graph
    sup: Supervisor | None  # None: a frontend that was already running (`--against`); no faults
    frontends: dict[str, Address]  # frontend key -> address
    client: httpx.AsyncClient

    def frontend(self, check: SmokeCheck) -> str:
        return check.frontend or next(iter(self.frontends))


def check_name(check: SmokeCheck, index: int) -> str:
    """The check's `name`, else its position and kind (`3: chat, streamed`)."""
    request = check.chat or check.completion
    streamed = ", streamed" if request is not None and request.stream else ""
    return check.name or f"{index + 1}: {check.kind}{streamed}"


async def run_check(target: Target, check: SmokeCheck, index: int) -> CheckResult:
    started = time.monotonic()
    try:
        failures, detail = await _dispatch(target, check)
    except TimeoutError:
        failures, detail = [f"no answer within {check.timeout_s:g} s (timeout_s)"], ""
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # unreachable, or a malformed answer
        failures, detail = [f"{type(e).__name__}: {e}".rstrip(": ")], ""
    outcome = "failed" if failures else "passed"
    return CheckResult(check_name(check, index), outcome, time.monotonic() - started, failures, detail)


async def _dispatch(target: Target, check: SmokeCheck) -> tuple[list[str], str]:
    if check.fault is not None:
        return await _fault(target, check.fault)
    address = target.frontends[target.frontend(check)]
    if check.models is not None:
        async with asyncio.timeout(check.timeout_s):
            return await _models(target.client, address, check.models)
    if check.metrics is not None:
        async with asyncio.timeout(check.timeout_s + METRICS_SETTLE_S):
            return await _metrics(target.client, address, check.metrics)
    return await _request(target, check, address)


async def _request(target: Target, check: SmokeCheck, address: Address) -> tuple[list[str], str]:
    request = check.chat or check.completion
    assert request is not None
    model = served_models(target.graph, target.frontend(check))[0]
    expect = check.expect or Expect()
    failures: list[str] = []
    answers: list[Answer] = []
    for i in range(check.repeat):
        answer = await asyncio.wait_for(
            send(target.client, address.url, request, model, address.headers), check.timeout_s
        )
        answers.append(answer)
        prefix = f"request {i + 1}/{check.repeat}: " if check.repeat > 1 else ""
        failures += [prefix + f for f in unmet(answer, expect)]
    return failures, _measured(answers)


def _measured(answers: list[Answer]) -> str:
    """The slowest answer's numbers (the one a budget would catch)."""
    worst = max(answers, key=lambda a: a.latency_s)
    parts = [f"{worst.status}"]
    if worst.ttft_s is not None:
        parts.append(f"ttft {worst.ttft_s * 1000:.0f} ms")
    parts.append(f"latency {worst.latency_s * 1000:.0f} ms")
    if worst.completion_tokens is not None:
        parts.append(f"{worst.completion_tokens} tokens")
    if worst.finish_reason:
        parts.append(worst.finish_reason)
    return (f"{len(answers)}x, slowest: " if len(answers) > 1 else "") + ", ".join(parts)


def api_key_headers(graph: Graph, frontend: str) -> dict[str, str]:
    """The bearer header of the first key in the variables a frontend's `api_key_env` names
    (as `up` passes them on), if any."""
    keys = [
        key.strip()
        for name in graph.frontends()[frontend].api_key_env
        for key in os.environ.get(name, "").split(",")
        if key.strip()
    ]
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


async def wait_models(
    client: httpx.AsyncClient, graph: Graph, frontends: dict[str, Address], wanted: dict[str, list[str]]
) -> str:
    """Wait until each frontend lists the models `wanted` of it; returns what is missing."""
    deadline = time.monotonic() + MODELS_TIMEOUT_S
    while True:
        missing = []
        for key, address in frontends.items():
            try:
                listed = await listed_models(client, address)
            except httpx.HTTPStatusError as e:
                if e.response.status_code in (401, 403):  # waiting will not help
                    names = ", ".join(graph.frontends()[key].api_key_env)
                    return f"{key}: GET /v1/models: {e.response.status_code}; set a key in {names}"
                missing.append(f"{key}: GET /v1/models: {e}")
                continue
            except (httpx.HTTPError, ValueError) as e:
                missing.append(f"{key}: GET /v1/models: {e}")
                continue
            if absent := [m for m in wanted.get(key, []) if m not in listed]:
                missing.append(f"{key} does not list {', '.join(absent)} after {MODELS_TIMEOUT_S:g} s")
        if not missing or time.monotonic() > deadline:
            return "; ".join(missing)
        await asyncio.sleep(POLL_S * 2)


async def listed_models(client: httpx.AsyncClient, address: Address) -> list[str]:
    """The model ids `/v1/models` lists; raises httpx.HTTPStatusError on an error status."""
    response = await client.get(address.url + "/v1/models", headers=address.headers)
    response.raise_for_status()
    return [str(m.get("id")) for m in response.json().get("data", [])]


async def _models(client: httpx.AsyncClient, address: Address, names: list[str]) -> tuple[list[str], str]:
    listed = await listed_models(client, address)
    missing = [n for n in names if n not in listed]
    return [f"/v1/models does not list {n!r} (it lists {listed})" for n in missing], ", ".join(listed)


async def _metrics(client: httpx.AsyncClient, address: Address, texts: list[str]) -> tuple[list[str], str]:
    """Every expression must hold; polled for a moment, since a request's counters may trail
    its response."""
    exprs = [parse_metric_expr(t) for t in texts]
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        response = await client.get(address.url + "/metrics", headers=address.headers)
        if response.status_code != 200:
            return [f"GET /metrics: status {response.status_code}"], ""
        values = [e.value(response.text) for e in exprs]
        failures = [
            f"{e}: no sample matches" if v is None else f"{e}: the value is {v:g}"
            for e, v in zip(exprs, values, strict=True)
            if v is None or not e.holds(v)
        ]
        if not failures or time.monotonic() > deadline:
            detail = ", ".join(
                f"{e.name} = {v:g}" for e, v in zip(exprs, values, strict=True) if v is not None
            )
            return failures, detail
        await asyncio.sleep(POLL_S * 4)


def _runner(sup: Supervisor | None, fault: SmokeFault) -> Runner | None:
    if sup is None:
        return None
    return next(
        (
            r
            for r in sup.runners.values()
            if r.spec.component == fault.kill and r.spec.replica == fault.replica
        ),
        None,
    )


async def _fault(target: Target, fault: SmokeFault) -> tuple[list[str], str]:
    """Signal the replica's process group; wait until it is gone, or (wait_ready) back and ready."""
    runner = _runner(target.sup, fault)
    what = f"{fault.kill} replica {fault.replica}"
    if runner is None or runner.record.pid is None or runner.record.state != "ready":
        state = runner.record.state if runner else "not in the plan"
        return [f"{what} is not running ({state})"], ""
    record = runner.record
    restarts, pid = record.restarts, record.pid
    if runner.proc is None or not runner.proc.send_signal(signal.Signals[fault.signal]):
        return [f"{what} could not be sent {fault.signal} (it ended, or its host is not connected)"], ""
    spec = runner.spec
    limit = spec.shutdown_grace_s + spec.restart.backoff_max_s + spec.readiness.timeout_s + 10.0
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if runner.record.state == "failed":
            return [f"{what} failed after the {fault.signal}: {runner.record.message}"], ""
        if not fault.wait_ready and runner.record.pid != pid:
            return [], f"{fault.signal} to pid {pid}; {runner.record.state}"
        if fault.wait_ready and runner.record.restarts > restarts and runner.ready.is_set():
            return [], f"{fault.signal} to pid {pid}; ready again as pid {runner.record.pid}"
        await asyncio.sleep(POLL_S)
    return [
        f"{what} not {'ready again' if fault.wait_ready else 'gone'} {limit:g} s after the {fault.signal}"
    ], ""
