"""`bench GRAPH --compare-static N,M`: plan before you buy. The graph's `autoscale` against the
same graph with its autoscaled pools fixed at N, M, ... replicas, each brought up in turn under one
load (a `--profile` of steps and ramps, a `--trace`, a rate), the pools' ready replicas sampled
meanwhile. Per variant: the share of requests within the pools' targets (SLA attainment: TTFT, and
the request's median time between tokens, at most the tightest `target` of any autoscaled pool;
a lost request misses), TTFT and ITL p90, replica-seconds and lost requests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.table import Table

from dynamo_graph.bench.replicas import ReplicaSampler, replica_seconds
from dynamo_graph.graph.build import Built
from dynamo_graph.graph.schema import Autoscale


class CompareError(ValueError):
    """The graph has nothing to compare (exit 2)."""


def autoscaled(built: Built) -> dict[str, Autoscale]:
    pools = {k: w.autoscale for k, w in sorted(built.graph.workers().items()) if w.autoscale is not None}
    if not pools:
        raise CompareError(
            f"graph {built.plan.graph} has no worker with `autoscale:` to compare with static replicas"
        )
    return pools


def variants(pools: Sequence[str], counts: Sequence[int]) -> list[tuple[str, list[str]]]:
    """(label, overrides): the graph as it is, then every autoscaled pool at each static count."""
    out: list[tuple[str, list[str]]] = [("autoscale", [])]
    for n in counts:
        overrides = [o for p in pools for o in (f"components.{p}.replicas={n}", f"~components.{p}.autoscale")]
        out.append((f"static-{n}", overrides))
    return out


def targets(pools: dict[str, Autoscale]) -> dict[str, float]:
    """The tightest TTFT and ITL targets of the pools (ms), those given."""
    out = {}
    for name, key in (("ttft_ms", "ttft_p90_ms"), ("itl_ms", "itl_p90_ms")):
        given = [getattr(s.target, key) for s in pools.values() if getattr(s.target, key) is not None]
        if given:
            out[name] = min(given)
    return out


def attainment(rows: Sequence[dict], goal: dict[str, float]) -> float:
    """The share of requests (per-request rows of a bench result) answered within `goal`."""
    met = sum(
        bool(r["ok"])
        and r["ttft_ms"] <= goal.get("ttft_ms", float("inf"))
        and (r["output_tokens"] < 2 or r["itl_p50_ms"] <= goal.get("itl_ms", float("inf")))
        for r in rows
    )
    return round(met / len(rows), 4) if rows else 0.0


def figures(point: dict, samples: dict[str, list[tuple[float, int]]], goal: dict[str, float]) -> dict:
    """One variant's comparison figures from its load point and its pools' replica samples."""
    summary = point["summary"]
    start = min((s[0][0] for s in samples.values() if s), default=0.0)
    return {
        "requests": summary["requests"],
        "lost": summary["failed"],
        "sla_attainment": attainment(point["requests"], goal),
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "itl_p90_ms": summary["itl_ms"]["p90"],
        "replica_seconds": round(sum(replica_seconds(s) for s in samples.values()), 1),
        "max_ready": {pool: max((n for _, n in s), default=0) for pool, s in samples.items()},
        "replicas": {pool: [[round(t - start, 2), n] for t, n in s] for pool, s in samples.items()},
    }


def table(rows: Sequence[tuple[str, dict]], goal: dict[str, float]) -> Table:
    within = " and ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in goal.items())
    t = Table(title=f"autoscale vs static (SLA: {within})", title_justify="left")
    for column in (
        "variant",
        "requests",
        "lost",
        "SLA met",
        "TTFT p90",
        "ITL p90",
        "replica-s",
        "most ready",
    ):
        t.add_column(column, justify="left" if column == "variant" else "right")
    for name, f in rows:
        t.add_row(
            name,
            str(f["requests"]),
            f"[red]{f['lost']}[/]" if f["lost"] else "0",
            f"{f['sla_attainment']:.1%}",
            f"{f['ttft_p90_ms']:.1f} ms",
            f"{f['itl_p90_ms']:.1f} ms",
            f"{f['replica_seconds']:.1f}",
            " ".join(f"{p}={n}" for p, n in f["max_ready"].items()),
        )
    return t


@contextlib.contextmanager
def sampling(built: Built, pools: Sequence[str]) -> Iterator[dict[str, list[tuple[float, int]]]]:
    """The pools' ready replicas, sampled while the block runs; the dict is filled at its end."""
    samplers = {pool: ReplicaSampler(Path(built.plan.state_dir), pool) for pool in pools}
    samples: dict[str, list[tuple[float, int]]] = {}
    for sampler in samplers.values():
        sampler.start()
    try:
        yield samples
    finally:
        samples.update({pool: sampler.stop() for pool, sampler in samplers.items()})
