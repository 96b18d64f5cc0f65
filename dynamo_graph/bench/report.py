"""What `bench` prints and writes: the results table, the JSON files and the plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dynamo_graph.bench import plots
from dynamo_graph.bench.measure import Measured


def _ms(dist: dict) -> str:
    return "/".join(f"{dist[q]:.1f}" for q in ("p50", "p90", "p99"))


def variant_label(overrides: list[str]) -> str:
    """A short name for a sweep's variant: the last two parts of each key with its value
    (`components.frontend.router.mode=kv` -> `router.mode=kv`); `base` for none."""
    parts = []
    for override in overrides:
        key, _, value = override.partition("=")
        parts.append(".".join(key.split(".")[-2:]) + "=" + value)
    return " ".join(parts) or "base"


def table(rows: list[tuple[str, dict]]) -> Table:
    """One row per (variant, load point): counts, throughput, and p50 / p90 / p99 latencies."""
    t = Table(title="dyngraph bench (latencies in ms: p50/p90/p99)", title_justify="left")
    sweep = len(rows) > 1
    columns = ("variant", "load", "ok/sent", "req/s", "out tok/s", "cached", "TTFT", "ITL", "end to end")
    for column in columns:
        if column != "variant" or sweep:
            t.add_column(column, justify="left" if column in ("variant", "load") else "right")
    for variant, result in rows:
        for point in result["points"]:
            s = point["summary"]
            t.add_row(
                *([variant] if sweep else []),
                point["label"],
                f"{s['ok']}/{s['requests']}" if not s["failed"] else f"[red]{s['ok']}/{s['requests']}[/]",
                f"{s['requests_per_s']:.2f}",
                f"{s['output_tokens_per_s']:.1f}",
                f"{s['cached_tokens'] / s['prompt_tokens']:.0%}" if s["prompt_tokens"] else "-",
                _ms(s["ttft_ms"]),
                _ms(s["itl_ms"]),
                _ms(s["e2e_ms"]),
            )
    return t


def summaries(result: dict) -> list[dict]:
    """A result's points without their per-request rows and timelines: what a sweep's
    summary file keeps of each variant."""
    return [
        {"label": p["label"], "load": p["load"], "summary": p["summary"], "server": p["server"]}
        for p in result["points"]
    ]


def slug(text: str) -> str:
    """A file name for a variant: `router.mode=kv` -> `router.mode-kv`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "result"


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def draw(measured: Measured, out_dir: Path, stem: str, fmt: str, title: str) -> list[Path]:
    """The latency and timeline plots of one result."""
    return [
        plots.latency_plot(measured, out_dir / f"{stem}-latency.{fmt}", title),
        plots.timeline_plot(measured, out_dir / f"{stem}-timeline.{fmt}", title),
    ]


def show(console: Console, rendered: Table) -> None:
    """Print the table; whole when the output is not a terminal (a CI log, a file), where rich
    would otherwise assume 80 columns and cut figures short."""
    if not console.is_terminal:
        console = Console(file=console.file, width=160, soft_wrap=True)
    console.print(rendered)
