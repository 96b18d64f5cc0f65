"""The engine conformance kit: does an engine keep the `LLMEngine` contract (backend/engine.py)?

In the spirit of Dynamo's `dynamo_backend_common::testing::run_conformance(engine)`: every engine's
tests call

    report = await check_engine(make_engine, make_request, concurrency=8)

where `make_engine()` returns a fresh, un-started engine (or an awaitable of one) and
`make_request(max_tokens)` a request the engine accepts that asks for at most `max_tokens`
tokens: a `PreprocessedRequest` for a tokens-input engine, an OpenAI request object
(`ChatCompletionRequest`) for a text-input one. The request must be able to stream at least
`cancel_max_tokens` tokens unless cut short (the cancellation checks stop it mid-stream; e.g. for
echo_core, a prompt that long). Every check runs on an engine of its own and cleans it up; a
failure raises `ConformanceError` (an AssertionError) naming each failed check and why.

Checks (`CHECKS`, in order):

- cleanup_without_start: `cleanup()` on an engine never started returns (twice), leaking nothing.
- double_cleanup: `start()`, then `cleanup()` twice; the second is a no-op.
- start_returns_config: `start()` returns an `EngineConfig` whose `model_input` matches the
  request kind (PreprocessedRequest <-> "tokens", OpenAI request <-> "text").
- stream: a request streams `LLMEngineOutput` chunks with content and ends with exactly one
  chunk carrying a finish reason (the last), one of stop / length / eos, no `error`; its
  `completion_usage` (required of text engines) agrees with what was streamed: tokens engines
  report `completion_tokens` = the ids streamed and `prompt_tokens` = the prompt's ids; text
  engines at least one token per text chunk and no more than max_tokens.
- max_tokens: with max_tokens=3 no more than 3 tokens come (exactly 3 when it ends "length").
- cancellation: `context.stop_generating()` after the first chunk is observed: the stream ends
  with finish reason "cancelled" within `cancel_within_s`.
- abort: `abort(context)` of a stopped in-flight request, of an unknown context and of a finished
  request all return, and the stopped request's stream ends "cancelled" within the bound.
- concurrency: `concurrency` generate calls at once all complete, each as in `stream`.
- cleanup_after_use: after a finished, a cancelled and an abandoned (`aclose()` mid-stream)
  request, `cleanup()` leaves no task or thread the engine started running (within
  `cleanup_within_s`; the event loop's own executor threads excepted), and a generate after
  cleanup raises an `EngineError` or ends; it does not hang.

For pytest, `conformance_tests(...)` makes a test function parametrized by check::

    test_conformance = conformance_tests(make_engine, make_request)
    # or, when the factories need fixtures: a fixture that returns (make_engine, make_request)
    test_conformance = conformance_tests(factories="echo_factories")
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.errors import EngineError
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest
from dynamo_graph.runtime.context import Context

CHECKS = (
    "cleanup_without_start",
    "double_cleanup",
    "start_returns_config",
    "stream",
    "max_tokens",
    "cancellation",
    "abort",
    "concurrency",
    "cleanup_after_use",
)
NORMAL_FINISH = frozenset({"stop", "length", "eos"})
ALLOWED_FINISH = frozenset({"stop", "length", "eos", "cancelled", "error"})

EngineFactory = Callable[[], "LLMEngine | Awaitable[LLMEngine]"]
RequestFactory = Callable[[int], Any]


class ConformanceError(AssertionError):
    """One or more checks failed; `failures` maps each check to its message."""

    def __init__(self, failures: dict[str, str], engine: str) -> None:
        self.failures = failures
        lines = [f"{engine}: {len(failures)} conformance check(s) failed:"]
        lines += [f"  - {name}: {message}" for name, message in failures.items()]
        super().__init__("\n".join(lines))


@dataclass
class ConformanceReport:
    engine: str
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class _Options:
    concurrency: int
    max_tokens: int
    cancel_max_tokens: int
    cancel_within_s: float
    cleanup_within_s: float


@dataclass
class _Run:
    outputs: list[LLMEngineOutput]
    tokens: int
    text_chunks: int
    text: str

    @property
    def final(self) -> LLMEngineOutput | None:
        return self.outputs[-1] if self.outputs else None


class _Failed(Exception):
    pass


def _fail(message: str) -> _Failed:
    return _Failed(message)


async def _new_engine(make_engine: EngineFactory) -> LLMEngine:
    engine = make_engine()
    if inspect.isawaitable(engine):
        engine = await engine
    if not isinstance(engine, LLMEngine):
        raise _fail(f"make_engine() returned {type(engine).__name__}, not an LLMEngine")
    return engine


def _is_tokens(request: Any) -> bool:
    return isinstance(request, PreprocessedRequest)


def _summarize(run: _Run) -> str:
    reasons = [o.finish_reason for o in run.outputs if o.finish_reason is not None]
    return f"{len(run.outputs)} chunks, {run.tokens} tokens, {run.text_chunks} text chunks, finish {reasons}"


async def _collect(
    engine: LLMEngine,
    request: Any,
    context: Context,
    *,
    on_chunk: Callable[[int, LLMEngineOutput], Awaitable[None] | None] | None = None,
) -> _Run:
    outputs: list[LLMEngineOutput] = []
    tokens = text_chunks = 0
    parts: list[str] = []
    stream = engine.generate(request, context)
    try:
        async for out in stream:
            if not isinstance(out, LLMEngineOutput):
                raise _fail(f"generate yielded {type(out).__name__}, not LLMEngineOutput")
            outputs.append(out)
            tokens += len(out.token_ids)
            if out.text:
                text_chunks += 1
                parts.append(out.text)
            if on_chunk is not None:
                result = on_chunk(len(outputs), out)
                if inspect.isawaitable(result):
                    await result
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    return _Run(outputs, tokens, text_chunks, "".join(parts))


def _check_terminal(run: _Run, *, allowed: Collection[str], what: str) -> str:
    """Exactly one chunk with a finish reason, the last one, from `allowed`; returns it."""
    finals = [i for i, o in enumerate(run.outputs) if o.finish_reason is not None]
    if not run.outputs:
        raise _fail(f"{what}: generate yielded nothing; the last chunk must carry a finish_reason")
    if len(finals) != 1:
        raise _fail(f"{what}: expected exactly one chunk with a finish_reason, got {_summarize(run)}")
    if finals[0] != len(run.outputs) - 1:
        raise _fail(f"{what}: {len(run.outputs) - 1 - finals[0]} chunk(s) came after the final chunk")
    reason = run.outputs[-1].finish_reason
    assert reason is not None
    if reason not in ALLOWED_FINISH:
        raise _fail(f"{what}: finish_reason {reason!r} is not one of {sorted(ALLOWED_FINISH)}")
    if reason not in allowed:
        error = next((o.error for o in run.outputs if o.error), None)
        detail = f" (error: {error})" if error else ""
        raise _fail(f"{what}: ended with finish_reason {reason!r}{detail}; expected one of {sorted(allowed)}")
    return reason


def _check_complete(run: _Run, request: Any, max_tokens: int, what: str) -> None:
    """What `stream` checks of one finished request."""
    _check_terminal(run, allowed=NORMAL_FINISH, what=what)
    errors = [o.error for o in run.outputs if o.error]
    if errors:
        raise _fail(f"{what}: a chunk carries error {errors[0]!r} but the request finished normally")
    usage = run.outputs[-1].completion_usage
    if _is_tokens(request):
        if run.tokens == 0:
            raise _fail(f"{what}: no token ids were streamed ({_summarize(run)})")
        if usage is not None:
            if usage.completion_tokens != run.tokens:
                raise _fail(
                    f"{what}: completion_usage.completion_tokens is {usage.completion_tokens} "
                    f"but {run.tokens} token ids were streamed"
                )
            if usage.prompt_tokens != len(request.token_ids):
                raise _fail(
                    f"{what}: completion_usage.prompt_tokens is {usage.prompt_tokens} but the "
                    f"prompt has {len(request.token_ids)} token ids"
                )
        return
    if run.text_chunks == 0:
        raise _fail(f"{what}: no text was streamed ({_summarize(run)})")
    if usage is None:
        raise _fail(f"{what}: a text engine must report completion_usage on its final chunk")
    if not run.text_chunks <= usage.completion_tokens <= max_tokens:
        raise _fail(
            f"{what}: completion_usage.completion_tokens is {usage.completion_tokens}; with "
            f"{run.text_chunks} text chunks and max_tokens {max_tokens} it must be within "
            f"{run.text_chunks}..{max_tokens}"
        )


# ---- leak detection -----------------------------------------------------------------------------


@dataclass
class _Snapshot:
    tasks: set[asyncio.Task[Any]]
    threads: set[threading.Thread]

    @classmethod
    def take(cls) -> _Snapshot:
        return cls(set(asyncio.all_tasks()), set(threading.enumerate()))

    def leftovers(self) -> tuple[list[asyncio.Task[Any]], list[threading.Thread]]:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t not in self.tasks and t is not current and not t.done()]
        threads = [
            t
            for t in threading.enumerate()
            if t not in self.threads and t.is_alive() and not t.name.startswith("asyncio_")
        ]
        return tasks, threads

    async def wait_clean(self, within_s: float, what: str) -> None:
        deadline = time.monotonic() + within_s
        while True:
            tasks, threads = self.leftovers()
            if not tasks and not threads:
                return
            if time.monotonic() > deadline:
                names = [f"task {t.get_name()!r} ({_coro_name(t)})" for t in tasks]
                names += [f"thread {t.name!r}" for t in threads]
                raise _fail(f"{what}: still running {within_s:.1f}s after cleanup(): {', '.join(names)}")
            await asyncio.sleep(0.01)


def _coro_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or type(coro).__name__


# ---- the checks ---------------------------------------------------------------------------------


class _Checker:
    def __init__(self, make_engine: EngineFactory, make_request: RequestFactory, options: _Options) -> None:
        self.make_engine = make_engine
        self.make_request = make_request
        self.o = options

    @contextlib.asynccontextmanager
    async def engine(self, *, start: bool = True) -> AsyncIterator[LLMEngine]:
        engine = await _new_engine(self.make_engine)
        try:
            if start:
                config = await engine.start()
                if not isinstance(config, EngineConfig):
                    raise _fail(f"start() returned {type(config).__name__}, not EngineConfig")
            yield engine
        finally:
            with contextlib.suppress(Exception):
                await engine.cleanup()

    async def cleanup_without_start(self) -> None:
        snapshot = _Snapshot.take()
        engine = await _new_engine(self.make_engine)
        try:
            await asyncio.wait_for(engine.cleanup(), self.o.cleanup_within_s)
        except TimeoutError:
            raise _fail(
                f"cleanup() before start() did not return within {self.o.cleanup_within_s}s"
            ) from None
        except Exception as err:
            raise _fail(f"cleanup() before start() raised {type(err).__name__}: {err}") from None
        try:
            await asyncio.wait_for(engine.cleanup(), self.o.cleanup_within_s)
        except Exception as err:
            raise _fail(f"a second cleanup() before start() raised {type(err).__name__}: {err}") from None
        await snapshot.wait_clean(self.o.cleanup_within_s, "cleanup() before start()")

    async def double_cleanup(self) -> None:
        engine = await _new_engine(self.make_engine)
        await engine.start()
        await engine.cleanup()
        try:
            await asyncio.wait_for(engine.cleanup(), self.o.cleanup_within_s)
        except TimeoutError:
            raise _fail(f"a second cleanup() did not return within {self.o.cleanup_within_s}s") from None
        except Exception as err:
            raise _fail(f"a second cleanup() raised {type(err).__name__}: {err}") from None

    async def start_returns_config(self) -> None:
        engine = await _new_engine(self.make_engine)
        try:
            config = await engine.start()
            if not isinstance(config, EngineConfig):
                raise _fail(f"start() returned {type(config).__name__}, not EngineConfig")
            if config.model_input not in ("tokens", "text"):
                raise _fail(f"EngineConfig.model_input is {config.model_input!r}, not 'tokens' or 'text'")
            request = self.make_request(self.o.max_tokens)
            expected = "tokens" if _is_tokens(request) else "text"
            if config.model_input != expected:
                raise _fail(
                    f"EngineConfig.model_input is {config.model_input!r} but make_request builds "
                    f"{type(request).__name__} requests (a {expected}-input engine's)"
                )
        finally:
            await engine.cleanup()

    async def stream(self) -> None:
        async with self.engine() as engine:
            request = self.make_request(self.o.max_tokens)
            run = await _collect(engine, request, Context())
            _check_complete(run, request, self.o.max_tokens, "a request")

    async def max_tokens(self) -> None:
        limit = 3
        async with self.engine() as engine:
            request = self.make_request(limit)
            run = await _collect(engine, request, Context())
            reason = _check_terminal(run, allowed=NORMAL_FINISH, what=f"max_tokens={limit}")
            if _is_tokens(request):
                if run.tokens > limit:
                    raise _fail(f"max_tokens={limit}: {run.tokens} token ids were streamed")
                if reason == "length" and run.tokens != limit:
                    raise _fail(f"max_tokens={limit}: ended with 'length' after {run.tokens} tokens")
            else:
                usage = run.outputs[-1].completion_usage
                if run.text_chunks > limit or (usage is not None and usage.completion_tokens > limit):
                    counted = usage.completion_tokens if usage is not None else "?"
                    raise _fail(
                        f"max_tokens={limit}: {run.text_chunks} text chunks, completion_tokens {counted}"
                    )

    async def _cancel_mid_stream(self, engine: LLMEngine, *, abort: bool) -> None:
        context = Context()
        request = self.make_request(self.o.cancel_max_tokens)
        stopped_at: list[float] = []

        async def on_chunk(index: int, out: LLMEngineOutput) -> None:
            if stopped_at or out.finish_reason is not None or not (out.token_ids or out.text):
                return
            context.stop_generating()
            stopped_at.append(time.monotonic())
            if abort:
                try:
                    await asyncio.wait_for(engine.abort(context), self.o.cancel_within_s)
                except TimeoutError:
                    raise _fail(f"abort(context) did not return within {self.o.cancel_within_s}s") from None

        what = "abort" if abort else "cancellation"
        try:
            run = await asyncio.wait_for(
                _collect(engine, request, context, on_chunk=on_chunk), self.o.cancel_within_s + 30.0
            )
        except TimeoutError:
            raise _fail(f"{what}: the stream did not end after stop_generating()") from None
        if not stopped_at:
            raise _fail(
                f"{what}: the request ended before a chunk with content came ({_summarize(run)}); "
                f"make_request({self.o.cancel_max_tokens}) must stream more than one chunk"
            )
        reason = _check_terminal(run, allowed=ALLOWED_FINISH, what=what)
        took = time.monotonic() - stopped_at[0]
        if reason != "cancelled":
            raise _fail(
                f"{what}: context.stop_generating() was not observed: the stream ended with "
                f"{reason!r} ({_summarize(run)})"
            )
        if took > self.o.cancel_within_s:
            raise _fail(f"{what}: the 'cancelled' chunk came {took:.2f}s after stop_generating()")

    async def cancellation(self) -> None:
        async with self.engine() as engine:
            await self._cancel_mid_stream(engine, abort=False)

    async def abort(self) -> None:
        async with self.engine() as engine:
            await self._cancel_mid_stream(engine, abort=True)
            try:
                await asyncio.wait_for(engine.abort(Context()), self.o.cancel_within_s)
            except Exception as err:
                raise _fail(f"abort() of an unknown context raised {type(err).__name__}: {err}") from None
            context = Context()
            request = self.make_request(self.o.max_tokens)
            await _collect(engine, request, context)
            try:
                await asyncio.wait_for(engine.abort(context), self.o.cancel_within_s)
            except Exception as err:
                raise _fail(f"abort() of a finished request raised {type(err).__name__}: {err}") from None

    async def concurrency(self) -> None:
        n = self.o.concurrency
        async with self.engine() as engine:
            requests = [self.make_request(self.o.max_tokens) for _ in range(n)]
            results = await asyncio.gather(
                *(_collect(engine, r, Context()) for r in requests), return_exceptions=True
            )
            for i, (request, result) in enumerate(zip(requests, results, strict=True)):
                what = f"request {i + 1} of {n} concurrent"
                if isinstance(result, _Failed):
                    raise _fail(f"{what}: {result}")
                if isinstance(result, BaseException):
                    raise _fail(f"{what} raised {type(result).__name__}: {result}")
                _check_complete(result, request, self.o.max_tokens, what)

    async def cleanup_after_use(self) -> None:
        snapshot = _Snapshot.take()
        engine = await _new_engine(self.make_engine)
        try:
            await engine.start()
            request = self.make_request(self.o.max_tokens)
            run = await _collect(engine, request, Context())
            _check_complete(run, request, self.o.max_tokens, "a request")
            await self._cancel_mid_stream(engine, abort=False)
            # A consumer that goes away without stopping the context (aclose mid-stream).
            stream = engine.generate(self.make_request(self.o.cancel_max_tokens), Context())
            async for _ in stream:  # type: ignore[attr-defined]
                break
            await stream.aclose()  # type: ignore[attr-defined]
        finally:
            try:
                await asyncio.wait_for(engine.cleanup(), self.o.cleanup_within_s)
            except TimeoutError:
                raise _fail(f"cleanup() did not return within {self.o.cleanup_within_s}s") from None
        await snapshot.wait_clean(self.o.cleanup_within_s, "after use")
        try:
            after = await asyncio.wait_for(
                _collect(engine, self.make_request(self.o.max_tokens), Context()), self.o.cleanup_within_s
            )
        except EngineError:
            return
        except TimeoutError:
            raise _fail("generate after cleanup() hangs; raise EngineShutdown instead") from None
        if after.final is None or after.final.finish_reason is None:
            raise _fail("generate after cleanup() ended without a final chunk; raise EngineShutdown instead")


async def check_engine(
    make_engine: EngineFactory,
    make_request: RequestFactory,
    *,
    concurrency: int = 8,
    max_tokens: int = 8,
    cancel_max_tokens: int = 256,
    cancel_within_s: float = 2.0,
    cleanup_within_s: float = 5.0,
    timeout_s: float = 120.0,
    only: Collection[str] | None = None,
    raise_on_failure: bool = True,
) -> ConformanceReport:
    """Run the conformance checks (all of `CHECKS`, or `only` those); see the module docstring.
    Raises ConformanceError listing every failed check (unless raise_on_failure=False)."""
    unknown = sorted(set(only or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; known: {', '.join(CHECKS)}")
    options = _Options(concurrency, max_tokens, cancel_max_tokens, cancel_within_s, cleanup_within_s)
    checker = _Checker(make_engine, make_request, options)
    report = ConformanceReport(engine=_engine_name(make_engine))
    for name in CHECKS:
        if only is not None and name not in only:
            continue
        try:
            await asyncio.wait_for(getattr(checker, name)(), timeout_s)
        except TimeoutError:
            report.failed[name] = f"did not finish within {timeout_s:.0f}s (an engine call hangs)"
        except _Failed as err:
            report.failed[name] = str(err)
        except Exception as err:
            report.failed[name] = f"raised {type(err).__name__}: {err}"
        else:
            report.passed.append(name)
    if report.failed and raise_on_failure:
        raise ConformanceError(report.failed, report.engine)
    return report


def _engine_name(make_engine: EngineFactory) -> str:
    name = getattr(make_engine, "__qualname__", None) or type(make_engine).__name__
    return f"engine from {name}"


def conformance_tests(
    make_engine: EngineFactory | None = None,
    make_request: RequestFactory | None = None,
    *,
    factories: str | None = None,
    **options: Any,
) -> Callable[..., None]:
    """A pytest test function, parametrized by check, that runs `check_engine` one check at a
    time. Give the factories, or the name of a fixture that returns (make_engine, make_request)."""
    import pytest

    if (make_engine is None or make_request is None) and factories is None:
        raise ValueError("conformance_tests needs make_engine and make_request, or factories=FIXTURE")

    @pytest.mark.parametrize("check", CHECKS)
    def test_engine_conformance(check: str, request: pytest.FixtureRequest) -> None:
        engine_factory, request_factory = (
            (make_engine, make_request) if factories is None else request.getfixturevalue(factories)
        )
        asyncio.run(check_engine(engine_factory, request_factory, only=[check], **options))

    return test_engine_conformance
