"""From a run's per-request results to the figures users compare: latency percentiles (TTFT,
ITL, end to end), requests/s and tokens/s, and the same over time for the plots; and the CPU
time of one call, for the micro-benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from dynamo_graph.bench.loadgen import Run
from dynamo_graph.bench.stream import Result

PERCENTILES = (50, 90, 99)


def cpu_us_per_call(fn: Callable[[], object], iterations: int, rounds: int = 5) -> float:
    """CPU microseconds of one `fn()`: the best of `rounds` rounds of `iterations` calls, the
    round least disturbed by other work on the machine."""
    fn()  # warm up
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(iterations):
            fn()
        best = min(best, time.process_time() - start)
    return best / iterations * 1e6


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation); 0.0 for no values."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def distribution_ms(values: Sequence[float]) -> dict[str, float]:
    """mean and p50/p90/p99 of seconds, in milliseconds."""
    out = {"mean": round(float(np.mean(values)) * 1000, 3) if len(values) else 0.0}
    for q in PERCENTILES:
        out[f"p{q}"] = round(percentile(values, q) * 1000, 3)
    return out


def summarize(run: Run) -> dict:
    """The figures of one load point."""
    ok = [r for r in run.results if r.ok]
    wall = run.wall_s or 1e-9
    errors = sorted({r.error for r in run.results if not r.ok})
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(run.results),
        "ok": len(ok),
        "failed": len(run.results) - len(ok),
        "errors": errors[:5],
        "duration_s": round(run.wall_s, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(output / wall, 2),
        "total_tokens_per_s": round((output + prompt) / wall, 2),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "itl_ms": distribution_ms([g for r in ok for g in r.gaps]),
        # time per output token after the first, per request (vLLM's TPOT): unlike ITL, not
        # split by how the tokens were grouped into reads
        "tpot_ms": distribution_ms(
            [(r.total - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),
        "e2e_ms": distribution_ms([r.total for r in ok]),
    }


def per_request(results: Sequence[Result]) -> list[dict]:
    """One compact row per request, in sending order: enough to redraw every plot."""
    return [
        {
            "index": r.index,
            "ok": r.ok,
            "start_s": round(r.start, 4),
            "ttft_ms": round(r.ttft * 1000, 3),
            "e2e_ms": round(r.total * 1000, 3),
            "itl_p50_ms": round(percentile(r.gaps, 50) * 1000, 3),
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens,
            **({"error": r.error} if r.error else {}),
        }
        for r in sorted(results, key=lambda r: r.start)
    ]


def _median_ms(rs: list[Result], value: Callable[[Result], float]) -> float | None:
    return round(percentile([value(r) for r in rs], 50) * 1000, 3) if rs else None


def timeline(results: Sequence[Result], wall_s: float, max_bins: int = 40) -> dict[str, list]:
    """Throughput and latency over time: per time bin, requests and output tokens finished per
    second, and the median TTFT and end-to-end latency of the requests that started in it (None
    where none did). About five requests a bin at least, so that short runs are not all noise."""
    ok = [r for r in results if r.ok]
    bins = max(1, min(max_bins, len(ok) // 5))
    width = max(wall_s, 1e-3) / bins
    finished = [0.0] * bins
    tokens = [0.0] * bins
    started: list[list[Result]] = [[] for _ in range(bins)]
    for r in ok:
        end = min(bins - 1, int((r.start + r.total) / width))
        finished[end] += 1 / width
        tokens[end] += r.output_tokens / width
        started[min(bins - 1, int(r.start / width))].append(r)
    return {
        "t_s": [round((i + 0.5) * width, 4) for i in range(bins)],
        "requests_per_s": [round(v, 3) for v in finished],
        "output_tokens_per_s": [round(v, 2) for v in tokens],
        "ttft_p50_ms": [_median_ms(rs, lambda r: r.ttft) for rs in started],
        "e2e_p50_ms": [_median_ms(rs, lambda r: r.total) for rs in started],
    }
