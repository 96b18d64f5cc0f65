"""`dyngraph top`: top.py's table in the terminal, refreshed every second (rich Live), with keys
to sort and filter; `--once` prints one table (or its JSON) for scripts.

Keys: `s` sorts by the next column, `r` reverses, `/` filters (type a pattern, Enter applies,
Esc drops it), `c` clears the filter, `q` (or Ctrl-C) quits. Keys are read in cbreak mode, so
the terminal is restored however `top` ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table as RichTable
from rich.text import Text

from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.local.top import (
    SORT_KEYS,
    Row,
    Sample,
    Table,
    arrange,
    descending_by_default,
    sample,
    table,
)

STATE_STYLE = {"ready": "green", "starting": "yellow", "failed": "red", "stopped": "dim", "backoff": "red"}


@dataclass
class View:
    """What the keys change."""

    sort: str = "name"
    descending: bool = False
    pattern: str = ""
    typing: str | None = None  # the filter being typed after `/`
    done: bool = False

    def key(self, ch: str) -> None:
        if self.typing is not None:
            if ch in ("\r", "\n"):
                self.pattern, self.typing = self.typing, None
            elif ch == "\x1b":
                self.typing = None
            elif ch in ("\x7f", "\b"):
                self.typing = self.typing[:-1]
            elif ch.isprintable():
                self.typing += ch
            return
        if ch == "q":
            self.done = True
        elif ch == "s":
            self.sort = SORT_KEYS[(SORT_KEYS.index(self.sort) + 1) % len(SORT_KEYS)]
            self.descending = descending_by_default(self.sort)
        elif ch == "r":
            self.descending = not self.descending
        elif ch == "/":
            self.typing = ""
        elif ch == "c":
            self.pattern = ""


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render(t: Table, view: View) -> RenderableType:
    rows = arrange(t.rows, view.sort, view.descending, view.pattern)
    procs = RichTable(title=f"{t.graph}  {time.strftime('%H:%M:%S', time.localtime(t.at))}", expand=True)
    for name in ("process", "host", "state"):
        procs.add_column(name, no_wrap=True)
    for name in ("req/s", "in fl", "TTFT ms 50/90", "ITL ms 50/90", "tok/s", "KV", "queue", "rst", "rev"):
        procs.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        procs.add_row(*_cells(r))
    models = RichTable(title="models", expand=True)
    models.add_column("model", no_wrap=True)
    for name in ("req/s", "err/s", "in fl", "TTFT ms 50/90", "ITL ms 50/90", "tok/s"):
        models.add_column(name, justify="right", no_wrap=True)
    for m in t.models:
        models.add_row(
            m.model,
            _num(m.requests_per_s),
            _num(m.errors_per_s),
            _num(m.inflight, "{:.0f}"),
            f"{_num(m.ttft_p50_ms, '{:.0f}')}/{_num(m.ttft_p90_ms, '{:.0f}')}",
            f"{_num(m.itl_p50_ms, '{:.0f}')}/{_num(m.itl_p90_ms, '{:.0f}')}",
            _num(m.tokens_per_s),
        )
    parts: list[RenderableType] = [procs, models]
    parts += [Text(f"planner: {line}") for line in t.planner_lines]
    order = "desc" if view.descending else "asc"
    status = f"sort: {view.sort} ({order})  filter: {view.pattern or '-'}"
    if view.typing is not None:
        status = f"filter: /{view.typing}_"
    parts.append(Text(f"{status}   keys: s sort  r reverse  / filter  c clear  q quit", style="dim"))
    return Group(*parts)


def _cells(r: Row) -> list[str | Text]:
    return [
        r.name,
        r.host,
        Text(r.state, style=STATE_STYLE.get(r.state, "")),
        _num(r.requests_per_s),
        _num(r.inflight, "{:.0f}"),
        f"{_num(r.ttft_p50_ms, '{:.0f}')}/{_num(r.ttft_p90_ms, '{:.0f}')}",
        f"{_num(r.itl_p50_ms, '{:.0f}')}/{_num(r.itl_p90_ms, '{:.0f}')}",
        _num(r.tokens_per_s),
        _pct(r.kv_usage),
        _num(r.queue, "{:.0f}"),
        str(r.restarts),
        str(r.revision),
    ]


@contextlib.contextmanager
def _cbreak() -> Iterator[int | None]:
    """stdin in cbreak mode (keys one at a time, no echo) while inside; None when not a tty."""
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _keys(fd: int | None, timeout_s: float) -> str:
    """The keys pressed within `timeout_s` (waits that long when none)."""
    if fd is None:
        time.sleep(timeout_s)
        return ""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return os.read(fd, 64).decode(errors="replace") if ready else ""


def top(
    state: StateDir, console: Console, *, once: bool, as_json: bool, interval_s: float, view: View
) -> int:
    """The live view until `q`; with `once`, two samples `interval_s` apart printed once."""
    first = asyncio.run(sample(state))
    if first is None:
        console.print(f"[bold red]error:[/] graph in {state.root} has never run; `dyngraph up` it first")
        return 2
    if once:
        time.sleep(interval_s)
        second = asyncio.run(sample(state)) or first
        t = table(first, second)
        if as_json:
            console.print_json(json.dumps(t.as_json()))
        else:
            console.print(render(t, view))
        return 0
    prev: Sample = first
    current = table(None, first)
    with (
        _cbreak() as fd,
        Live(render(current, view), console=console, auto_refresh=False, screen=True) as live,
    ):
        next_at = time.monotonic() + interval_s
        while not view.done:
            changed = False
            for ch in _keys(fd, max(0.0, next_at - time.monotonic())):
                view.key(ch)
                changed = True
            if time.monotonic() >= next_at:
                cur = asyncio.run(sample(state)) or prev
                current, prev = table(prev, cur), cur
                next_at = time.monotonic() + interval_s
                changed = True
            if changed:
                live.update(render(current, view), refresh=True)
    return 0
