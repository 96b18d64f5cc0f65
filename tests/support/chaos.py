"""The chaos run: mocker workers killed with -9 at random under streaming load and restarted at
once (as a supervisor would), summarised per run: completed, failed cleanly or not, kills,
migrations, TTFT and latency. tests/system/test_chaos.py checks its reports;
benchmarks/bench_chaos.py runs it with bigger numbers."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tests.support.mocker_cluster import Cluster
from tests.support.streaming import KEEPALIVE_S, StreamResult, completion_body, stream_completion


@dataclass
class ChaosConfig:
    workers: int = 3
    concurrency: int = 200  # streams in flight at once, each client sending one after another
    duration_s: float = 30.0  # how long clients keep starting requests (and kills go on)
    kill_every_s: float = 2.0
    kills: bool = True
    max_tokens: int = 64
    prompts: int = 50  # distinct prompts, so an undisturbed run gives each one's usage
    max_requests: int = 5000  # bound on the total, whatever the speed
    request_timeout_s: float = 60.0
    seed: int = 7
    quiet_duration_s: float | None = None  # the undisturbed run's duration (None: duration_s)


@dataclass
class ChaosReport:
    requests: int = 0
    completed: int = 0  # status 200, [DONE], one finish reason "length", max_tokens tokens
    failed_clean: int = 0  # an error event after bytes, or a 5xx with an OpenAI error body
    failed_unclean: int = 0  # anything else: hangs, a body-less 5xx, a truncated stream, ...
    kills: int = 0
    migrations: int = 0
    wrong_usage: int = 0  # completed, but token counts differ from the undisturbed run's
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    wall_s: float = 0.0
    unclean_examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def classify(result: StreamResult, max_tokens: int) -> str:
    """ "completed", "clean" (a failure a client can read) or "unclean"."""
    if result.complete(max_tokens):
        return "completed"
    if result.exception is not None:
        return "unclean"
    if result.status == 200:
        # Started streaming: it must end with exactly one error event and [DONE], no finish.
        clean = len(result.errors) == 1 and result.done and not result.finish_reasons
        return "clean" if clean and result.errors[0].get("message") else "unclean"
    try:
        error = json.loads(result.body)["error"]
    except (ValueError, KeyError, TypeError):
        return "unclean"
    return "clean" if result.status >= 500 and error.get("message") else "unclean"


class Killer(threading.Thread):
    """Every `every_s`: kill -9 a random registered worker and start its replacement."""

    def __init__(self, cluster: Cluster, every_s: float, until: float, seed: int) -> None:
        super().__init__(daemon=True, name="chaos killer")
        self.cluster = cluster
        self.every_s = every_s
        self.until = until
        self.random = random.Random(seed)
        self.kills = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.every_s) and time.monotonic() < self.until:
            ready = [w for w in self.cluster.workers if w.instance() and w.proc.poll() is None]
            if not ready:
                continue
            self.cluster.kill9(self.random.choice(ready))
            self.kills += 1
            self.cluster.start_worker()  # the supervisor's restart


async def _load(base_url: str, model: str, cfg: ChaosConfig, until: float) -> list[tuple[int, StreamResult]]:
    results: list[tuple[int, StreamResult]] = []
    counter = iter(range(cfg.max_requests))
    limits = httpx.Limits(
        max_connections=cfg.concurrency + 8,
        max_keepalive_connections=cfg.concurrency,
        keepalive_expiry=KEEPALIVE_S,
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s), limits=limits) as http:

        async def client() -> None:
            while time.monotonic() < until:
                i = next(counter, None)
                if i is None:
                    return
                prompt = i % cfg.prompts
                body = completion_body(model, f"chaos prompt number {prompt}: tell a story", cfg.max_tokens)
                try:
                    result = await asyncio.wait_for(
                        stream_completion(http, base_url, body), cfg.request_timeout_s + 5
                    )
                except TimeoutError:
                    result = StreamResult(exception="TimeoutError: the request hung")
                results.append((prompt, result))

        await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
    return results


def undisturbed_usage(cluster: Cluster, cfg: ChaosConfig) -> dict[int, tuple[int, int, int]]:
    """Each prompt's token counts with no worker killed (the reference for every run)."""
    quiet = ChaosConfig(**{**asdict(cfg), "kills": False, "duration_s": 0.0})
    quiet.max_requests = cfg.prompts
    report, results = run_load(cluster, quiet, until_all=True)
    usage = {p: r.token_counts for p, r in results if r.complete(cfg.max_tokens) and r.token_counts}
    assert len(usage) == cfg.prompts, report
    return usage


def run_load(
    cluster: Cluster,
    cfg: ChaosConfig,
    *,
    until_all: bool = False,
    reference: dict[int, tuple[int, int, int]] | None = None,
) -> tuple[ChaosReport, list[tuple[int, StreamResult]]]:
    """Run the load (with kills when cfg.kills) and summarise it."""
    migrations_before = cluster.migrations()
    start = time.monotonic()
    until = float("inf") if until_all else start + cfg.duration_s
    killer = None
    if cfg.kills:
        killer = Killer(cluster, cfg.kill_every_s, start + cfg.duration_s, cfg.seed)
        killer.start()
    try:
        results = asyncio.run(_load(cluster.frontend.base_url, cluster.model, cfg, until))
    finally:
        if killer is not None:
            killer.stop_event.set()
            killer.join(timeout=30)
    report = ChaosReport(requests=len(results), kills=killer.kills if killer else 0)
    report.wall_s = round(time.monotonic() - start, 2)
    for prompt, result in results:
        kind = classify(result, cfg.max_tokens)
        if kind == "completed":
            report.completed += 1
            if reference is not None and result.token_counts != reference.get(prompt):
                report.wrong_usage += 1
        elif kind == "clean":
            report.failed_clean += 1
        else:
            report.failed_unclean += 1
            if len(report.unclean_examples) < 5:
                report.unclean_examples.append(repr(result)[:500])
    done = [r for _, r in results if r.complete(cfg.max_tokens)]
    ttfts = sorted(r.ttft for r in done if r.ttft is not None)
    latencies = sorted(r.latency for r in done)
    report.ttft_p50_s = round(_percentile(ttfts, 50), 4)
    report.ttft_p99_s = round(_percentile(ttfts, 99), 4)
    report.latency_p50_s = round(_percentile(latencies, 50), 4)
    report.latency_p99_s = round(_percentile(latencies, 99), 4)
    report.migrations = cluster.migrations() - migrations_before
    return report, results


def run_chaos(cluster: Cluster, cfg: ChaosConfig) -> tuple[ChaosReport, ChaosReport]:
    """(undisturbed run, chaos run) with the same load; the chaos run's usage is checked against
    the undisturbed run's for every prompt."""
    reference = undisturbed_usage(cluster, cfg)
    quiet_cfg = ChaosConfig(**{**asdict(cfg), "kills": False})
    quiet_cfg.duration_s = cfg.duration_s if cfg.quiet_duration_s is None else cfg.quiet_duration_s
    quiet, _ = run_load(cluster, quiet_cfg, reference=reference)
    cluster.wait_routable(cfg.workers)
    chaos, _ = run_load(cluster, cfg, reference=reference)
    return quiet, chaos
