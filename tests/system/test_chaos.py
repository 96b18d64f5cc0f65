"""Chaos: mocker workers killed with -9 at random while streaming requests run, and restarted
(as a supervisor would) at once. With a migration limit every request still completes with
exactly max_tokens tokens and one finish reason; without one, the requests that were on a
killed worker fail cleanly (an error event, or a 5xx with an OpenAI error body) and the rest
succeed. The run itself (tests/support/chaos.py) is also what benchmarks/bench_chaos.py runs, with
bigger numbers.

Default set: a short run (fewer requests and kills). `-m slow`: the issue's numbers (3 workers,
200 concurrent streams, a kill every 2 s for 30 s)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.support.chaos import ChaosConfig, ChaosReport, run_chaos, run_load, undisturbed_usage
from tests.support.mocker_cluster import Cluster


def _check_migrated(quiet: ChaosReport, chaos: ChaosReport) -> None:
    assert quiet.requests > 0 and quiet.completed == quiet.requests and quiet.wrong_usage == 0, quiet
    assert chaos.kills >= 1, chaos
    assert chaos.failed_clean == 0 and chaos.failed_unclean == 0, chaos
    assert chaos.completed == chaos.requests > 0, chaos
    assert chaos.wrong_usage == 0, chaos
    assert chaos.migrations >= 1, chaos


def _check_failed_cleanly(chaos: ChaosReport) -> None:
    assert chaos.kills >= 1, chaos
    assert chaos.failed_unclean == 0, chaos
    assert chaos.failed_clean >= 1, chaos  # requests were in flight on the killed workers
    assert chaos.completed + chaos.failed_clean == chaos.requests, chaos
    assert chaos.completed > chaos.failed_clean, chaos  # the rest succeed
    assert chaos.wrong_usage == 0 and chaos.migrations == 0, chaos


def _print(name: str, report: ChaosReport) -> None:
    print(f"{name}: {json.dumps(report.as_dict())}")


SHORT = ChaosConfig(concurrency=24, duration_s=8.0, kill_every_s=2.0, prompts=24, quiet_duration_s=4.0)
FULL = ChaosConfig(concurrency=200, duration_s=30.0, kill_every_s=2.0, prompts=50)
SPEEDUP = 0.25  # mocker: 64 tokens take ~1.5 s of simulated time


def test_chaos_short_with_migration_every_request_completes(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(workers=SHORT.workers, limit=3, speedup=SPEEDUP)
    quiet, chaos = run_chaos(cluster, SHORT)
    _print("undisturbed", quiet)
    _print("chaos", chaos)
    _check_migrated(quiet, chaos)


def test_chaos_short_without_migration_fails_only_the_affected_cleanly(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(workers=SHORT.workers, limit=0, speedup=SPEEDUP)
    reference = undisturbed_usage(cluster, SHORT)
    chaos, _ = run_load(cluster, SHORT, reference=reference)
    _print("chaos, limit 0", chaos)
    _check_failed_cleanly(chaos)


@pytest.mark.slow
def test_chaos_full_with_migration_every_request_completes(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(workers=FULL.workers, limit=3, speedup=SPEEDUP)
    quiet, chaos = run_chaos(cluster, FULL)
    _print("undisturbed", quiet)
    _print("chaos", chaos)
    _check_migrated(quiet, chaos)


@pytest.mark.slow
def test_chaos_full_without_migration_fails_only_the_affected_cleanly(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(workers=FULL.workers, limit=0, speedup=SPEEDUP)
    reference = undisturbed_usage(cluster, FULL)
    chaos, _ = run_load(cluster, FULL, reference=reference)
    _print("chaos, limit 0", chaos)
    _check_failed_cleanly(chaos)
