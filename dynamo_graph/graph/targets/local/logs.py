"""Reading process logs: the last lines of one, several interleaved by time, and following many
at once with name prefixes."""

from __future__ import annotations

import asyncio
import calendar
import heapq
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

POLL_S = 0.05
_HEAD = 80  # a line's timestamp, if it has one, is near its start
# 2026-11-24T14:50:00.123Z (ours, etcd's), 2026/11/24 14:50:00.123456 (nats-server), with or
# without a zone; without one it is local time.
_STAMP = re.compile(
    r"(\d{4})[-/](\d{2})[-/](\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?(Z|[+-]\d{2}:?\d{2})?"
)


def tail_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of a log (reads at most the last 256 KiB)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.decode(errors="replace").splitlines()
    return lines[-n:] if n > 0 else []


class LogFollower:
    """Polls log files and hands each new complete line to `emit(process, line)`.

    Files are polled rather than piped so that following works the same for the foreground
    supervisor and for `dyngraph logs -f` on a detached one.
    """

    def __init__(self, emit: Callable[[str, str], None]) -> None:
        self.emit = emit
        self._files: dict[str, tuple[Path, int, bytes]] = {}  # name -> (path, offset, partial line)

    def add(self, name: str, path: Path, *, from_end: bool) -> None:
        if name in self._files:
            return
        offset = path.stat().st_size if from_end and path.exists() else 0
        self._files[name] = (path, offset, b"")

    def poll(self) -> None:
        for name, (path, offset, partial) in list(self._files.items()):
            try:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            *lines, partial = (partial + chunk).split(b"\n")
            self._files[name] = (path, offset + len(chunk), partial)
            for line in lines:
                self.emit(name, line.decode(errors="replace"))

    async def run(self) -> None:
        """Poll until cancelled, then flush what is there."""
        try:
            while True:
                self.poll()
                await asyncio.sleep(POLL_S)
        finally:
            self.poll()


def line_time(line: str) -> float | None:
    """When a log line was written, if it says: a timestamp near its start, or a JSON log
    line's `time` (ours, seconds since the epoch) or `ts` (etcd's)."""
    if line.startswith("{"):
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict):
            stamp = entry.get("time", entry.get("ts"))
            if isinstance(stamp, int | float):
                return float(stamp)
            if isinstance(stamp, str):
                line = stamp
    match = _STAMP.search(line[:_HEAD])
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction = float(f"0.{match.group(7)}") if match.group(7) else 0.0
    fields = (year, month, day, hour, minute, second, 0, 0, -1)
    zone = match.group(8)
    if zone is None:
        return time.mktime(fields) + fraction
    offset = (
        0 if zone == "Z" else (1 if zone[0] == "+" else -1) * (int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
    )
    return calendar.timegm(fields) + fraction - offset


def _timed(order: int, name: str, lines: list[str]) -> Iterator[tuple[float, int, int, str, str]]:
    """Each line with a time that never goes back within the log: a line without a timestamp
    (a traceback, a program's plain print) takes its predecessor's, or its first successor's."""
    times = [line_time(line) for line in lines]
    known = [t for t in times if t is not None]
    current = known[0] if known else 0.0
    for i, (line, stamp) in enumerate(zip(lines, times, strict=True)):
        current = max(current, stamp) if stamp is not None else current
        yield current, order, i, name, line


def interleaved(logs: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(process, line) of several logs merged by time; each log keeps its own order, lines of
    the same time go in the order the logs are given, and logs with no timestamps at all first."""
    merged = heapq.merge(*(_timed(order, name, lines) for order, (name, lines) in enumerate(logs.items())))
    return [(name, line) for *_, name, line in merged]
