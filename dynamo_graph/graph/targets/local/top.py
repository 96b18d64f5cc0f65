"""`dyngraph top`'s data: a running graph's processes and what they are doing, as table rows.

A `Sample` is one look at the graph: the supervisor's process records and plan (state dir), each
worker's instance id (the "instance <hex> serving" line of its log), and every ready frontend's
/health (per instance: requests, errors, time to first response and between responses, counted
by the frontend's client, runtime/traffic.py) and /metrics (per model: requests, in flight, TTFT,
ITL and output-token histograms; with kv routing, per worker rank the load it last reported and
its KV capacity, frontend/router_metrics.py). Two samples make the rows (`table`): rates and
percentiles are over the interval between them (differences of counters and of histogram
buckets), gauges are the latest. Rendering is top_view.py's; this module has no terminal.

Per row: a frontend's numbers are its component's (its replicas share a port and /metrics answers
for all of them, frontend/group.py), shown on each replica; a worker's are its instance's as all
frontends saw it. A worker's tokens/s counts its responses (one per token for engines that stream
every token; fewer when an engine batches tokens into one response).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local import probes
from dynamo_graph.graph.targets.local.answers import INSTANCE_LINE, Answers, health_at, side, tally
from dynamo_graph.graph.targets.local.history import autoscale_decisions, autoscale_lines
from dynamo_graph.graph.targets.local.monitoring import frontend_endpoints
from dynamo_graph.graph.targets.local.state import ProcessRecord, StateDir
from dynamo_graph.runtime.traffic import percentile_ms

FRONTEND = "dynamo_frontend"
ROUTER = f"{FRONTEND}_router"
SCRAPE_TIMEOUT_S = 2.0
LOG_TAIL_BYTES = 1 << 20  # where a worker's latest "instance ... serving" line is looked for

# per model: a histogram's upper bound (le) -> its cumulative count
Buckets = dict[str, Counter[float]]


@dataclass
class FrontendScrape:
    """One frontend component's /metrics, reduced to what `top` shows."""

    requests: Counter[str] = field(default_factory=Counter)  # per model, every status
    errors: Counter[str] = field(default_factory=Counter)
    inflight: Counter[str] = field(default_factory=Counter)
    output_tokens: Counter[str] = field(default_factory=Counter)  # sum of the OSL histogram
    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    queue: Counter[str] = field(default_factory=Counter)  # the kv router's queue, per model
    kv_used: dict[str, float] = field(default_factory=dict)  # per worker instance (hex), blocks
    kv_total: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)  # per worker instance, its report
    running: dict[str, float] = field(default_factory=dict)


@dataclass
class Sample:
    at: float
    plan: Plan
    records: list[ProcessRecord]
    instances: dict[str, str]  # worker process name -> instance id (hex)
    answers: dict[str, Answers]  # per instance id, summed over frontends
    frontends: dict[str, FrontendScrape]  # per frontend component
    decisions: dict[str, dict[str, Any]]  # the autoscaler's last, per pool


@dataclass
class Row:
    """One process as `top` shows it; None: not known (shown as a dash)."""

    component: str
    name: str
    kind: str  # "frontend" | "worker" | "service"
    host: str
    state: str
    instance: str | None = None
    requests_per_s: float | None = None
    inflight: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    tokens_per_s: float | None = None
    kv_usage: float | None = None  # 0..1
    queue: float | None = None
    restarts: int = 0
    revision: int = 0


@dataclass
class ModelRow:
    """One model over every frontend."""

    model: str
    requests_per_s: float
    errors_per_s: float
    inflight: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    tokens_per_s: float


@dataclass
class Table:
    at: float
    graph: str
    rows: list[Row]
    models: list[ModelRow]
    planner: dict[str, dict[str, Any]]  # pool -> its last decision
    planner_lines: list[str]  # the same as `status` words it

    def as_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "graph": self.graph,
            "processes": [asdict(r) for r in self.rows],
            "models": [asdict(m) for m in self.models],
            "planner": self.planner,
        }


# ---- reading -------------------------------------------------------------------------------------


def parse_metrics(text: str) -> FrontendScrape:
    """The families `top` reads from a frontend's /metrics text."""
    out = FrontendScrape()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels, value = s.labels, s.value
            model = labels.get("model", "")
            if s.name == f"{FRONTEND}_requests_total":
                out.requests[model] += value
                if labels.get("status") == "error":
                    out.errors[model] += value
            elif s.name == f"{FRONTEND}_inflight_requests":
                out.inflight[model] += value
            elif s.name == f"{FRONTEND}_output_sequence_tokens_sum":
                out.output_tokens[model] += value
            elif s.name in (
                f"{FRONTEND}_time_to_first_token_seconds_bucket",
                f"{FRONTEND}_inter_token_latency_seconds_bucket",
            ):
                target = out.ttft if "first_token" in s.name else out.itl
                target.setdefault(model, Counter())[float(labels["le"])] += value
            elif s.name == f"{ROUTER}_queue_depth":
                out.queue[model] += value
            elif s.name.startswith(ROUTER) and "worker_id" in labels:
                worker = labels["worker_id"]
                for suffix, into in (
                    ("reported_active_blocks", out.kv_used),
                    ("kv_capacity_blocks", out.kv_total),
                    ("reported_waiting_requests", out.waiting),
                    ("reported_running_requests", out.running),
                ):
                    if s.name == f"{ROUTER}_{suffix}":
                        into[worker] = into.get(worker, 0.0) + value
    return out


def instance_in_log(state: StateDir, name: str) -> str | None:
    """The instance id a worker's latest run announced (its log is appended across restarts)."""
    try:
        with state.log_file(name).open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
            found = INSTANCE_LINE.findall(log.read().decode(errors="replace"))
    except FileNotFoundError:
        return None
    return found[-1] if found else None


async def _get(url: str) -> bytes | None:
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT_S):
            status, _, body = await probes.http_get(url, asyncio.open_connection)
    except (OSError, TimeoutError, ValueError, IndexError):
        return None
    return body if status == 200 else None


def _frontend_urls(plan: Plan) -> dict[str, str | None]:
    """Per frontend component, the base URL of its /health and /metrics (its replicas share
    it); None where this machine cannot ask it (see monitoring.frontend_endpoints)."""
    return {
        e.component: None if e.address is None or e.loopback_remote else f"http://{e.address}"
        for e in frontend_endpoints(plan)
    }


async def sample(state: StateDir) -> Sample | None:
    """One look at the graph; None when it has never run."""
    plan = state.read_plan()
    if plan is None:
        return None
    records = [r for r in state.read_processes() if not r.retiring]
    urls = {component: url for component, url in _frontend_urls(plan).items() if url is not None}
    # Each frontend process's own /health (its client counted what it sent each worker), and
    # each component's /metrics (which answers for all its replicas).
    serving = [r for r in records if r.component in urls and r.state == "ready"]
    healths = asyncio.gather(
        *(health_at(f"{urls[r.component]}/health", asyncio.open_connection, r.pid) for r in serving)
    )
    metrics = asyncio.gather(*(_get(f"{url}/metrics") for url in urls.values()))
    answered, metrics_bodies = await asyncio.gather(healths, metrics)
    documents = [document for _, document in filter(None, answered)]
    frontends = {
        component: parse_metrics(body.decode(errors="replace"))
        for component, body in zip(urls, metrics_bodies, strict=True)
        if body is not None
    }
    workers = {s.name for s in plan.processes if s.component in plan_workers(plan)}
    instances = {name: i for name in sorted(workers) if (i := instance_in_log(state, name)) is not None}
    return Sample(
        at=time.time(),
        plan=plan,
        records=records,
        instances=instances,
        answers=tally(documents),
        frontends=frontends,
        decisions=autoscale_decisions(state),
    )


def plan_workers(plan: Plan) -> set[str]:
    """The components whose processes serve a model (their readiness waits for the serving line)."""
    return {
        s.component for s in plan.processes if s.readiness.kind == "log" and "serving" in s.readiness.target
    }


# ---- the table -----------------------------------------------------------------------------------


def _rate(now: float, before: float | None, seconds: float) -> float | None:
    if before is None or seconds <= 0:
        return None
    return max(now - before, 0.0) / seconds


def _histogram_quantile(now: Counter[float], before: Counter[float] | None, q: float) -> float | None:
    """The `q` quantile (ms) of the observations between two cumulative-bucket snapshots, by the
    upper bound of the bucket that holds it; None when there were none."""
    bounds = sorted(now)
    counts = [now[b] - (before or Counter())[b] for b in bounds]
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    for bound, seen in zip(bounds, counts, strict=True):
        if seen >= q * total:
            return None if math.isinf(bound) else bound * 1000
    return None


def _worker_row(row: Row, prev: Sample | None, cur: Sample, seconds: float) -> None:
    instance = row.instance
    if instance is None:
        return
    now = cur.answers.get(instance)
    if prev is not None and now is not None:
        delta = side(prev.answers, cur.answers, {instance})
        row.requests_per_s = delta.requests / seconds if seconds > 0 else None
        row.ttft_p50_ms = percentile_ms(delta.first_response_ms, 0.5)
        row.ttft_p90_ms = percentile_ms(delta.first_response_ms, 0.9)
        row.itl_p50_ms = percentile_ms(delta.between_responses_ms, 0.5)
        row.itl_p90_ms = percentile_ms(delta.between_responses_ms, 0.9)
        responses = sum(delta.first_response_ms.values()) + sum(delta.between_responses_ms.values())
        row.tokens_per_s = responses / seconds if seconds > 0 else None
    for scrape in cur.frontends.values():  # one frontend's view is enough: the rank's own report
        if instance in scrape.running:
            row.inflight = scrape.running[instance] + scrape.waiting.get(instance, 0.0)
            row.queue = scrape.waiting.get(instance)
        total = scrape.kv_total.get(instance)
        if total and instance in scrape.kv_used:
            row.kv_usage = scrape.kv_used[instance] / total
        if row.inflight is not None:
            break


def _frontend_row(row: Row, prev: Sample | None, cur: Sample, seconds: float) -> None:
    scrape = cur.frontends.get(row.component)
    if scrape is None:
        return
    before = prev.frontends.get(row.component) if prev is not None else None
    row.inflight = sum(scrape.inflight.values())
    row.queue = sum(scrape.queue.values())
    if before is not None:
        row.requests_per_s = _rate(sum(scrape.requests.values()), sum(before.requests.values()), seconds)
        row.tokens_per_s = _rate(
            sum(scrape.output_tokens.values()), sum(before.output_tokens.values()), seconds
        )
    ttft = _merged(scrape.ttft.values())
    itl = _merged(scrape.itl.values())
    ttft_before = _merged(before.ttft.values()) if before is not None else None
    itl_before = _merged(before.itl.values()) if before is not None else None
    if before is not None:
        row.ttft_p50_ms = _histogram_quantile(ttft, ttft_before, 0.5)
        row.ttft_p90_ms = _histogram_quantile(ttft, ttft_before, 0.9)
        row.itl_p50_ms = _histogram_quantile(itl, itl_before, 0.5)
        row.itl_p90_ms = _histogram_quantile(itl, itl_before, 0.9)


def _merged(buckets: Iterable[Counter[float]]) -> Counter[float]:
    total: Counter[float] = Counter()
    for b in buckets:
        total.update(b)
    return total


def _models(prev: Sample | None, cur: Sample, seconds: float) -> list[ModelRow]:
    names = sorted({m for s in cur.frontends.values() for m in s.requests} - {""})
    rows = []
    for model in names:

        def total(sample: Sample | None, attr: str, model: str = model) -> float | None:
            if sample is None:
                return None
            return sum(getattr(s, attr).get(model, 0.0) for s in sample.frontends.values())

        def buckets(sample: Sample | None, attr: str, model: str = model) -> Counter[float] | None:
            if sample is None:
                return None
            return _merged(
                getattr(s, attr)[model] for s in sample.frontends.values() if model in getattr(s, attr)
            )

        ttft, itl = buckets(cur, "ttft") or Counter(), buckets(cur, "itl") or Counter()
        ttft_before, itl_before = buckets(prev, "ttft"), buckets(prev, "itl")
        measured = prev is not None
        rows.append(
            ModelRow(
                model=model,
                requests_per_s=_rate(total(cur, "requests") or 0.0, total(prev, "requests"), seconds) or 0.0,
                errors_per_s=_rate(total(cur, "errors") or 0.0, total(prev, "errors"), seconds) or 0.0,
                inflight=total(cur, "inflight") or 0.0,
                ttft_p50_ms=_histogram_quantile(ttft, ttft_before, 0.5) if measured else None,
                ttft_p90_ms=_histogram_quantile(ttft, ttft_before, 0.9) if measured else None,
                itl_p50_ms=_histogram_quantile(itl, itl_before, 0.5) if measured else None,
                itl_p90_ms=_histogram_quantile(itl, itl_before, 0.9) if measured else None,
                tokens_per_s=_rate(total(cur, "output_tokens") or 0.0, total(prev, "output_tokens"), seconds)
                or 0.0,
            )
        )
    return rows


def table(prev: Sample | None, cur: Sample) -> Table:
    """The rows of `cur`, with rates over the interval since `prev` (none without one)."""
    seconds = cur.at - prev.at if prev is not None else 0.0
    workers = plan_workers(cur.plan)
    frontends = set(_frontend_urls(cur.plan))
    rows = []
    for record in cur.records:
        kind = (
            "frontend"
            if record.component in frontends
            else "worker"
            if record.component in workers
            else "service"
        )
        row = Row(
            component=record.component,
            name=record.name,
            kind=kind,
            host=record.host,
            state=record.state,
            instance=cur.instances.get(record.name),
            restarts=record.restarts,
            revision=record.revision,
        )
        if kind == "worker":
            _worker_row(row, prev, cur, seconds)
        elif kind == "frontend":
            _frontend_row(row, prev, cur, seconds)
        rows.append(row)
    planner = autoscale_lines(cur.plan, cur.decisions, {r.name: r for r in cur.records})
    return Table(cur.at, cur.plan.graph, rows, _models(prev, cur, seconds), cur.decisions, planner)


# ---- sorting and filtering -----------------------------------------------------------------------

TEXT_KEYS = ("name", "component", "host", "state")
SORT_KEYS = (*TEXT_KEYS, "requests_per_s", "inflight", "ttft_p90_ms", "kv_usage", "restarts")


def descending_by_default(sort: str) -> bool:
    """Numbers sort biggest first, words alphabetically."""
    return sort not in TEXT_KEYS


def arrange(rows: list[Row], sort: str = "name", descending: bool = False, pattern: str = "") -> list[Row]:
    """The rows whose name, component, host or state matches `pattern` (a regex, case-insensitive;
    a bad one matches as plain text), sorted by `sort` (unknown values last)."""
    if pattern:
        try:
            wanted = re.compile(pattern, re.IGNORECASE)
        except re.error:
            wanted = re.compile(re.escape(pattern), re.IGNORECASE)
        rows = [r for r in rows if any(wanted.search(v) for v in (r.name, r.component, r.host, r.state))]
    known = [r for r in rows if getattr(r, sort) is not None]
    unknown = [r for r in rows if getattr(r, sort) is None]
    return sorted(known, key=lambda r: getattr(r, sort), reverse=descending) + unknown
