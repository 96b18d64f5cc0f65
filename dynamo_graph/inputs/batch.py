"""`in=batch:FILE.jsonl`: run every prompt of a JSONL file and write the answers, as dynamo-run.

Each non-blank line is `{"text": "..."}`, sent as one user message. `output.jsonl`, next to the
input, gets one `{"text", "response", "tokens_in", "tokens_out", "elapsed_ms"}` per successful
line, in input order. A line that cannot be run (not JSON, not an object, no string "text", a
request the pipeline rejects, an engine failure) is reported as `FILE:LINE: reason` and skipped.

Memory stays bounded whatever the file size: lines are read lazily, `concurrency` workers run
requests, and a reorder buffer writes answers in input order as soon as the ones before them
are done. A window of `4 * concurrency` lines (queued, running or waiting for an earlier line)
stops the reader from running ahead of a slow request. Answers go to a temporary file that
replaces output.jsonl only when the run completes, so a crash never leaves half a file.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from array import array
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dynamo_graph.inputs.text import chat_request, error_message
from dynamo_graph.llm.openai import ChatMessage
from dynamo_graph.llm.pipeline import ModelPipeline
from dynamo_graph.runtime.context import Context

OUTPUT_NAME = "output.jsonl"


@dataclass(slots=True)
class _Job:
    seq: int  # position among the lines that were dispatched: the output order
    lineno: int
    text: str


@dataclass(slots=True)
class _Stats:
    ok: int = 0
    failed: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    elapsed_ms: array[float] = field(default_factory=lambda: array("d"))


def _parse_line(raw: bytes) -> str:
    """The prompt of one line; raises ValueError naming what is wrong with it."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise ValueError(f"not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f'expected a JSON object like {{"text": "..."}}, got {type(obj).__name__}')
    text = obj.get("text")
    if not isinstance(text, str):
        raise ValueError('missing "text" string field')
    return text


def _count_prompts(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def percentile(sorted_values: array[float] | list[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values (0.0 when there are none)."""
    if not sorted_values:
        return 0.0
    rank = max(math.ceil(pct / 100.0 * len(sorted_values)), 1)
    return sorted_values[rank - 1]


class _BatchRun:
    """One pass over the file: a reader, a pool of workers and an in-order writer."""

    def __init__(
        self,
        pipeline: ModelPipeline,
        path: Path,
        out: IO[bytes],
        progress: Progress,
        *,
        concurrency: int,
        ignore_eos: bool,
    ) -> None:
        self.pipeline = pipeline
        self.path = path
        self.out = out
        self.progress = progress
        self.task_id = progress.add_task(path.name, total=_count_prompts(path))
        self.concurrency = concurrency
        self.ignore_eos = ignore_eos
        self.window = asyncio.Semaphore(4 * concurrency)
        self.queue: asyncio.Queue[_Job | None] = asyncio.Queue()
        self.done: dict[int, bytes | None] = {}  # the reorder buffer: seq -> output line
        self.next_seq = 0
        self.stats = _Stats()

    async def run(self) -> _Stats:
        async with asyncio.TaskGroup() as tasks:
            for _ in range(self.concurrency):
                tasks.create_task(self._worker())
            await self._read()
            for _ in range(self.concurrency):
                self.queue.put_nowait(None)
        return self.stats

    async def _read(self) -> None:
        seq = 0
        with self.path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    text = _parse_line(raw)
                except ValueError as err:
                    self._fail(lineno, str(err))
                    continue
                await self.window.acquire()
                self.queue.put_nowait(_Job(seq, lineno, text))
                seq += 1

    async def _worker(self) -> None:
        while (job := await self.queue.get()) is not None:
            self._finish(job.seq, await self._answer(job))

    async def _answer(self, job: _Job) -> bytes | None:
        """The output line for `job`, or None when it failed (reported here)."""
        messages = [ChatMessage(role="user", content=job.text)]
        request = chat_request(self.pipeline, messages, ignore_eos=self.ignore_eos, stream=False)
        started = time.perf_counter()
        try:
            prepared = self.pipeline.prepare(request)
            parts = [delta.text async for delta in self.pipeline.stream(prepared, Context())]
        except Exception as err:
            self._fail(job.lineno, error_message(err))
            return None
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        stats = self.stats
        stats.ok += 1
        stats.tokens_in += prepared.prompt_tokens
        stats.tokens_out += prepared.completion_tokens
        stats.elapsed_ms.append(elapsed_ms)
        self.progress.advance(self.task_id)
        record = {
            "text": job.text,
            "response": "".join(parts),
            "tokens_in": prepared.prompt_tokens,
            "tokens_out": prepared.completion_tokens,
            "elapsed_ms": round(elapsed_ms, 3),
        }
        return msgspec.json.encode(record) + b"\n"

    def _fail(self, lineno: int, reason: str) -> None:
        self.stats.failed += 1
        self.progress.console.print(
            f"{self.path}:{lineno}: {reason}", style="red", markup=False, soft_wrap=True
        )
        self.progress.advance(self.task_id)

    def _finish(self, seq: int, line: bytes | None) -> None:
        """Write every answer that is now next in input order, freeing their window slots."""
        self.done[seq] = line
        while self.next_seq in self.done:
            ready = self.done.pop(self.next_seq)
            if ready is not None:
                self.out.write(ready)
            self.next_seq += 1
            self.window.release()


def _summary(console: Console, path: Path, out_path: Path, stats: _Stats, wall_s: float) -> None:
    latencies = sorted(stats.elapsed_ms)
    wall = max(wall_s, 1e-9)
    mean_in = stats.tokens_in / stats.ok if stats.ok else 0.0
    mean_out = stats.tokens_out / stats.ok if stats.ok else 0.0
    style = "green" if not stats.failed else "yellow"
    console.print(
        f"[{style}]{path.name}: {stats.ok} ok, {stats.failed} failed[/] in {wall_s:.2f} s -> {out_path}"
    )
    console.print(
        f"tokens in: {stats.tokens_in} (mean {mean_in:.1f}, {stats.tokens_in / wall:.1f}/s) · "
        f"tokens out: {stats.tokens_out} (mean {mean_out:.1f}, {stats.tokens_out / wall:.1f}/s)"
    )
    console.print(
        f"request elapsed: p50 {percentile(latencies, 50):.2f} ms · p99 {percentile(latencies, 99):.2f} ms",
        soft_wrap=True,
    )


async def run_batch(
    pipeline: ModelPipeline, path: str, *, concurrency: int = 8, ignore_eos: bool = False
) -> int:
    """Run the file's prompts; 0 if every line succeeded, 1 if some failed."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    src = Path(path)
    out_path = src.parent / OUTPUT_NAME
    tmp_path = src.parent / f".{OUTPUT_NAME}.{os.getpid()}.tmp"
    console = Console(stderr=True, highlight=False)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # a log file gets the summary, not bar redraws
    )
    started = time.perf_counter()
    try:
        with tmp_path.open("wb") as out, progress:
            stats = await _BatchRun(
                pipeline, src, out, progress, concurrency=concurrency, ignore_eos=ignore_eos
            ).run()
        os.replace(tmp_path, out_path)
    except BaseException:
        with suppress(OSError):
            tmp_path.unlink()
        raise
    _summary(console, src, out_path, stats, time.perf_counter() - started)
    return 0 if stats.failed == 0 else 1
