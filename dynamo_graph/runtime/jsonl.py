"""Append-only JSON lines written off the hot path, bounded by size with rotation.

The router's decision log and the frontend's request recording write a line per request from
the event loop. `write` only appends the record to a deque; a background thread encodes and
writes what has gathered every `flush_s` (so a slow disk never stalls a request) and flushes.
Past `max_bytes` the file rotates as logging's RotatingFileHandler does: PATH becomes PATH.1,
PATH.1 becomes PATH.2, ... up to PATH.`keep`, the oldest dropped. Records beyond `max_pending`
waiting to be written are dropped and counted (`dropped`): memory stays bounded whatever the
disk does.

Several processes may share one file (a frontend's replicas, the old and new run of a rollout):
each batch is one `write` on an O_APPEND descriptor, so lines never interleave, and a writer
whose file was rotated away by another process reopens PATH (as logging's WatchedFileHandler).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger(__name__)

FLUSH_S = 0.2
MAX_PENDING = 65536


class JsonLines:
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = 0,
        keep: int = 0,
        max_pending: int = MAX_PENDING,
        flush_s: float = FLUSH_S,
    ) -> None:
        """`max_bytes`: rotate past this size (0: never); `keep`: rotated files kept (0: the
        full file is truncated instead)."""
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.max_pending = max_pending
        self.flush_s = flush_s
        self.dropped = 0
        self.written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = -1
        self._open()
        self._pending: deque[Any] = deque()
        self._encoder = msgspec.json.Encoder()
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=f"jsonl {self.path.name}", daemon=True)
        self._thread.start()

    def write(self, record: Any) -> None:
        """Queue one record (a msgspec-encodable value, not changed afterwards) for writing."""
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append(record)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self._drain()
        self._drain()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._inode = os.fstat(self._fd).st_ino

    def _drain(self) -> None:
        pending = self._pending
        if not pending:
            return
        encode = self._encoder.encode
        try:
            try:
                moved = os.stat(self.path).st_ino != self._inode
            except FileNotFoundError:
                moved = True
            if moved:  # another process rotated it
                os.close(self._fd)
                self._open()
            size = os.fstat(self._fd).st_size
            batch = bytearray()
            while pending:
                line = encode(pending.popleft()) + b"\n"
                if self.max_bytes and size + len(batch) + len(line) > self.max_bytes and size + len(batch):
                    os.write(self._fd, batch)
                    batch.clear()
                    self._rotate()
                    size = 0
                batch += line
                self.written += 1
            os.write(self._fd, batch)
        except OSError as err:  # a full or vanished disk: say so once, keep serving
            if not self._failed:
                log.error("cannot write %s: %s; its records are dropped", self.path, err)
                self._failed = True
            self.dropped += len(pending)
            pending.clear()

    def _rotate(self) -> None:
        os.close(self._fd)
        if self.keep:
            for n in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{n}")
                if older.exists():
                    older.replace(self.path.with_name(f"{self.path.name}.{n + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._open()

    def close(self) -> None:
        """Write what is queued and close the file."""
        self._stop.set()
        self._thread.join(timeout=10)
        os.close(self._fd)
