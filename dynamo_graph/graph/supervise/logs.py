"""Reading process logs: the last lines of one, and following many at once with name prefixes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.05


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
