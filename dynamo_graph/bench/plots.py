"""Plots of a benchmark, so that a person can look rather than read: latency distributions
(CDFs of TTFT, ITL and end-to-end latency, one line per load point), throughput and latency over
time, and a sweep's variants side by side. matplotlib is the optional `plot` extra."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dynamo_graph.bench.measure import Measured

FORMATS = ("png", "svg")
EXTRA_HINT = "install the plotting extra: pip install -e '.[plot]' in dyngraph's checkout (matplotlib)"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend; PlotsUnavailable names the extra."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(f"plots need matplotlib: {EXTRA_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    ordered = np.sort(values_ms)
    ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)


def latency_plot(measured: Measured, out: Path, title: str) -> Path:
    """TTFT, ITL and end-to-end latency CDFs, one line per load point."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for point, run in zip(measured.result["points"], measured.runs, strict=True):
        ok = [r for r in run.results if r.ok]
        _cdf(axes[0], [r.ttft * 1000 for r in ok], point["label"])
        _cdf(axes[1], [g * 1000 for r in ok for g in r.gaps], point["label"])
        _cdf(axes[2], [r.total * 1000 for r in ok], point["label"])
    for ax, name in zip(
        axes, ("time to first token", "inter-token latency", "end-to-end latency"), strict=True
    ):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests" if ax is not axes[1] else "share of token gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def timeline_plot(measured: Measured, out: Path, title: str) -> Path:
    """Throughput (requests/s and output tokens/s finished) and median latency over time."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 7), sharex=True)
    panels = (
        ("requests_per_s", "requests/s finished"),
        ("output_tokens_per_s", "output tokens/s"),
        ("ttft_p50_ms", "TTFT p50 (ms) of requests started"),
        ("e2e_p50_ms", "end-to-end p50 (ms) of requests started"),
    )
    for point in measured.result["points"]:
        line = point["timeline"]
        for ax, (key, _) in zip(axes.flat, panels, strict=True):
            values = np.array(line[key], dtype=float)  # None (no request started) -> a gap
            ax.plot(line["t_s"], values, marker=".", label=point["label"])
    for ax, (_, name) in zip(axes.flat, panels, strict=True):
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[1]:
        ax.set_xlabel("seconds since the point's start")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


SWEEP_PANELS = (
    ("ttft_ms", "p50", "TTFT p50 (ms)"),
    ("ttft_ms", "p99", "TTFT p99 (ms)"),
    ("itl_ms", "p50", "ITL p50 (ms)"),
    ("e2e_ms", "p90", "end-to-end p90 (ms)"),
    ("requests_per_s", None, "requests/s"),
    ("output_tokens_per_s", None, "output tokens/s"),
)


def sweep_plot(variants: list[tuple[str, dict]], out: Path, title: str) -> Path:
    """The variants' figures side by side: one bar per variant in each load point's group."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    labels = [p["label"] for p in variants[0][1]["points"]] if variants else []
    width = 0.8 / max(1, len(variants))
    x = np.arange(len(labels))
    for ax, (key, q, name) in zip(axes.flat, SWEEP_PANELS, strict=True):
        for i, (variant, result) in enumerate(variants):
            values = [p["summary"][key][q] if q else p["summary"][key] for p in result["points"]]
            ax.bar(x[: len(values)] + i * width - 0.4 + width / 2, values, width, label=variant)
        ax.set_title(name)
        ax.set_xticks(x, labels)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def autoscale_plot(variants: list[tuple[str, dict, list[dict]]], goal: dict[str, float], out: Path) -> Path:
    """`--compare-static`: per variant (name, figures, per-request rows), the ready replicas over
    time above, each request's TTFT by when it started below, the TTFT target as a line."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, figures, rows in variants:
        for pool, steps in figures["replicas"].items():
            if steps:
                times, counts = zip(*steps, strict=True)
                label = f"{name} {pool} ({figures['replica_seconds']} replica-s)"
                top.step(times, counts, where="post", label=label)
        ok = [r for r in rows if r["ok"]]
        bottom.scatter(
            [r["start_s"] for r in ok],
            [r["ttft_ms"] for r in ok],
            s=3,
            label=f"{name} (SLA met {figures['sla_attainment']:.0%})",
        )
    if "ttft_ms" in goal:
        bottom.axhline(goal["ttft_ms"], color="red", linewidth=1, label="TTFT target")
    top.set_ylabel("ready replicas")
    bottom.set_ylabel("TTFT (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8, markerscale=3)
    fig.suptitle("autoscale vs static pools, one load")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
