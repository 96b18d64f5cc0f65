"""Continuous streamed load for the rollout tests: official `openai` clients, each with its own
kept-alive connection and no retries, streaming chats in a loop on threads until stopped. Every
request that does not end with a finish reason counts as failed, with what went wrong."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from openai import OpenAI

MAX_REQUESTS = 20_000  # per client: a bound, far above what a test's minutes produce
MAX_SECONDS = 300.0


@dataclass
class LoadResult:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total(self) -> int:
        return self.ok + len(self.failures)


class StreamingLoad:
    """`clients` threads streaming chats to `base_url` until `stop()` (or the bounds above)."""

    def __init__(
        self, base_url: str, model: str, clients: int = 4, max_tokens: int = 12, pause_s: float = 0.0
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.max_tokens = max_tokens
        self.pause_s = pause_s  # each client's wait between its requests (a light, steady load)
        self.result = LoadResult()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> StreamingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        return self.result

    def wait_for_requests(self, count: int, timeout: float = 30.0) -> None:
        """Until `count` more requests ended (the load is flowing)."""
        target = self.result.total + count
        deadline = time.monotonic() + timeout
        while self.result.total < target:
            assert time.monotonic() < deadline, f"load stalled at {self.result.total} requests"
            time.sleep(0.02)

    def _loop(self, index: int) -> None:
        client = OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + MAX_SECONDS
        for n in range(MAX_REQUESTS):
            if self._stop.is_set() or time.monotonic() > deadline:
                return
            self._one(client, f"client {index} request {n}: tell me about rolling updates")
            self._stop.wait(self.pause_s)

    def _one(self, client: OpenAI, prompt: str) -> None:
        started = time.monotonic()
        first: float | None = None
        finish = None
        try:
            stream = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_tokens,
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and first is None:
                    first = time.monotonic() - started
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            error = None if finish else "the stream ended without a finish reason"
        except Exception as e:  # every failure the client sees is what the test counts
            cause = e.__cause__ or e.__context__  # "Connection error." says what only with its cause
            error = f"{type(e).__name__}: {e}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
        with self.result.lock:
            if error is None:
                self.result.ok += 1
                self.result.ttfts.append(first or 0.0)
            else:
                self.result.failures.append(f"{time.strftime('%H:%M:%S')} {error}")
