"""One benchmark of one running frontend: the workload at every load point, with a progress bar,
what the server's /metrics counted beside what the client saw, and the result as JSON."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dynamo_graph.bench import loadgen, server, stats, workload
from dynamo_graph.bench.loadgen import Run, Target
from dynamo_graph.bench.replicas import Phase, arrivals, profile_seconds
from dynamo_graph.bench.stream import Result


@dataclass(frozen=True)
class Load:
    """One load point: a closed loop of `level` users, an open loop of `level` requests/s
    (Poisson), a trace replayed at its own timestamps, or the settings' load profile (steps and
    ramps, replicas.py)."""

    mode: Literal["closed", "open", "trace", "profile"]
    level: float = 0.0

    @property
    def label(self) -> str:
        if self.mode == "closed":
            return f"c={int(self.level)}"
        return f"rate={self.level:g}/s" if self.mode == "open" else self.mode

    def as_json(self) -> dict:
        key = {"closed": "concurrency", "open": "rate"}.get(self.mode)
        return {"mode": self.mode, **({key: self.level} if key else {})}


@dataclass(frozen=True)
class Settings:
    """Everything that makes the load: the same for every variant of a sweep."""

    loads: list[Load]
    api: Literal["completions", "chat"] = "completions"
    requests: int | None = None  # per point; None: 100, or the whole trace
    input_len: int = 128
    output_len: int = 64
    prefix_len: int = 0
    num_prefixes: int = 1
    trace: Path | None = None
    profile: tuple[Phase, ...] = ()  # the "profile" load's phases
    trace_speedup: float = 1.0
    trace_block_size: int = workload.MOONCAKE_BLOCK_SIZE
    seed: int = 0
    reuse_prompts: bool = False  # the same prompts at every load point (each gets its own by default)
    max_seconds: float = 120.0
    request_timeout_s: float = 300.0
    warmup: int = 0
    ignore_eos: bool = True
    model: str | None = None
    tokenizer: Path | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict:
        out = {
            "api": self.api,
            "requests_per_point": self.requests,
            "seed": self.seed,
            "prompts_per_point": "the same" if self.reuse_prompts else "fresh",
            "max_seconds_per_point": self.max_seconds,
            "request_timeout_s": self.request_timeout_s,
            "warmup_requests": self.warmup,
            "ignore_eos": self.ignore_eos,
        }
        if self.profile:
            out["profile"] = [list(phase) for phase in self.profile]
        if self.trace is not None:
            out |= {"trace": str(self.trace), "trace_speedup": self.trace_speedup}
            out["trace_block_size"] = self.trace_block_size
        else:
            out |= {"input_len": self.input_len, "output_len": self.output_len}
            out |= {"prefix_len": self.prefix_len, "num_prefixes": self.num_prefixes}
        return out


@dataclass
class Measured:
    """A benchmark's JSON result, and its runs (every token gap, for the plots)."""

    result: dict
    runs: list[Run]

    @property
    def failed(self) -> int:
        return sum(p["summary"]["failed"] for p in self.result["points"])


@dataclass(frozen=True)
class Prepared:
    """The workload's prompts, made once before anything starts and sent to every variant: one
    list per load point, and the warm-up's."""

    vocab: workload.Vocabulary
    points: list[list[workload.Prompt]]
    warmup: list[workload.Prompt]


def prepare(settings: Settings) -> Prepared:
    """Raises WorkloadError (a bad trace, impossible lengths, no tokenizer there).

    Each load point gets prompts of its own (shared prefixes and trace blocks too), drawn from
    the seed and the point's index, so that no point meets a prefix cache warmed by the points
    before it (the later points of `-c 1,8,32` would otherwise be mostly cached, the first not);
    so does the warm-up. `reuse_prompts` sends the first point's prompts at every point, and
    warms up with them, as a warm cache would see them."""
    if settings.tokenizer is None:
        vocab = workload.words_vocabulary()
    else:
        vocab = workload.tokenizer_vocabulary(settings.tokenizer)
    first = _prompts(settings, vocab, settings.seed)
    if settings.reuse_prompts:
        return Prepared(vocab, [first] * len(settings.loads), first[: settings.warmup])
    points = [first] + [
        _prompts(settings, vocab, f"{settings.seed}/point{i}") for i in range(1, len(settings.loads))
    ]
    warmup = (
        _prompts(settings, vocab, f"{settings.seed}/warmup")[: settings.warmup] if settings.warmup else []
    )
    return Prepared(vocab, points, warmup)


def _prompts(settings: Settings, vocab: workload.Vocabulary, seed: int | str) -> list[workload.Prompt]:
    if settings.trace is not None:
        return workload.trace(
            vocab,
            settings.trace,
            block_size=settings.trace_block_size,
            speedup=settings.trace_speedup,
            limit=settings.requests,
            seed=seed,
        )
    count = len(arrivals(settings.profile)) if settings.profile else settings.requests or 100
    return workload.synthetic(
        vocab,
        count=count,
        input_len=settings.input_len,
        output_len=settings.output_len,
        prefix_len=settings.prefix_len,
        num_prefixes=settings.num_prefixes,
        seed=seed,
    )


def progress_bar() -> Progress:
    """The bar `bench` draws on stderr: one line per load point."""
    from rich.console import Console

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def _run(target: Target, requests: list[loadgen.Request], load: Load, settings: Settings, on_result) -> Run:
    if load.mode == "closed":
        coro = loadgen.run_closed(
            target,
            requests,
            concurrency=int(load.level),
            max_seconds=settings.max_seconds,
            request_timeout_s=settings.request_timeout_s,
            on_result=on_result,
        )
    else:
        # a profile runs to its end, whatever --duration says
        limit = profile_seconds(settings.profile) + 1 if load.mode == "profile" else settings.max_seconds
        coro = loadgen.run_open(
            target,
            requests,
            max_seconds=limit,
            request_timeout_s=settings.request_timeout_s,
            on_result=on_result,
        )
    return asyncio.run(coro)


def measure(
    endpoint: server.Endpoint, settings: Settings, prepared: Prepared, progress: Progress, name: str = ""
) -> Measured:
    """Every load point of `settings` against the frontend at `endpoint`. Raises ServerError when
    it cannot be asked."""
    models = server.served_models(endpoint, settings.headers)
    model = settings.model or (models[0] if models else None)
    if model is None or model not in models:
        served = ", ".join(models) or "none"
        raise server.ServerError(f"{endpoint.url} serves no model {model!r} (it serves: {served})")
    vocab = prepared.vocab
    path = "/v1/chat/completions" if settings.api == "chat" else "/v1/completions"
    target = Target(endpoint.host, endpoint.port, path, headers=tuple(settings.headers.items()))

    def bodies(ps: list[workload.Prompt]) -> list[loadgen.Request]:
        return workload.to_requests(ps, vocab, api=settings.api, model=model, ignore_eos=settings.ignore_eos)

    if prepared.warmup:  # connections, caches, lazy imports: not measured
        warm = bodies(prepared.warmup)
        asyncio.run(loadgen.run_closed(target, warm, concurrency=min(4, len(warm)), max_seconds=60.0))
    points, runs = [], []
    for load, prompts in zip(settings.loads, prepared.points, strict=True):
        if load.mode == "open":
            timed = workload.poisson(prompts, load.level, settings.seed)
        elif load.mode == "profile":
            timed = workload.scheduled(prompts, arrivals(settings.profile))
        else:
            timed = prompts
        requests = bodies(timed)
        task = progress.add_task(f"{name}{' ' if name else ''}{load.label}", total=len(requests), failed=0)
        failed = 0

        def advance(result: Result, task: int = task) -> None:
            nonlocal failed
            failed += not result.ok
            progress.update(task, advance=1, failed=failed)

        before = server.scrape(endpoint, settings.headers, model)
        run = _run(target, requests, load, settings, advance)
        after = server.scrape(endpoint, settings.headers, model)
        progress.update(task, total=len(run.results))
        runs.append(run)
        points.append(
            {
                "load": load.as_json(),
                "label": load.label,
                "prompts_digest": workload.digest(prompts),
                "summary": stats.summarize(run),
                "server": server.delta(before, after),
                "timeline": stats.timeline(run.results, run.wall_s),
                "requests": stats.per_request(run.results),
            }
        )
    result = {
        "url": endpoint.url,
        "model": model,
        "prompts": "token ids" if vocab.exact and settings.api == "completions" else "text",
        "workload": settings.as_json(),
        "points": points,
    }
    return Measured(result, runs)
