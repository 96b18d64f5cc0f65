"""`in=text`: an interactive chat in the terminal, as dynamo-run's text input.

The conversation history (user and assistant turns) is sent with every request. Ctrl-C during
an answer stops that generation only (a second Ctrl-C stops waiting for the engine to wind
down); the cancelled or failed turn - the user's message and any partial answer - is left out
of the history, so the next request still alternates user/assistant as chat templates require.
Ctrl-C or Ctrl-D at the prompt ends the session with exit code 0. One loop signal handler routes
Ctrl-C for the whole session and gives the previous handler back at the end.

The prompt is read with `input()` in a daemon thread so the event loop keeps serving (leases,
watchers) while the user types. A daemon thread, not `asyncio.to_thread`: when the user quits
with Ctrl-C, the pending `input()` cannot be interrupted, and `asyncio.run` would wait for the
default executor's thread forever. Outside the main thread `input()` reads the terminal in
cooked mode (no GNU readline), so abandoning it leaves the terminal as it was.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from rich.console import Console
from rich.markup import escape

from dynamo_graph.backend.errors import EngineError
from dynamo_graph.llm.openai import ChatCompletionRequest, ChatMessage, NvExt
from dynamo_graph.llm.pipeline import ModelPipeline
from dynamo_graph.runtime.context import Context

log = logging.getLogger(__name__)

PROMPT = "[green]✔[/] [bold]User[/] · "


def chat_request(
    pipeline: ModelPipeline, messages: list[ChatMessage], *, ignore_eos: bool, stream: bool
) -> ChatCompletionRequest:
    """The request every non-HTTP input sends; `ignore_eos` lets echo engines show the whole
    template instead of stopping at its first end-of-turn token."""
    return ChatCompletionRequest(
        model=pipeline.name,
        messages=messages,
        stream=stream,
        nvext=NvExt(ignore_eos=True) if ignore_eos else None,
    )


def error_message(err: BaseException) -> str:
    """What a user is shown for a failed request."""
    text = str(err)
    if isinstance(err, (ValueError, EngineError)):
        return text or type(err).__name__
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def is_bad_request(err: BaseException) -> bool:
    """Errors caused by the request (the frontend's 4xx), as opposed to engine failures."""
    if isinstance(err, EngineError):
        return err.http_status < 500
    return isinstance(err, ValueError)


@contextmanager
def sigint_calls(callback: Callable[[], None]) -> Iterator[None]:
    """Route Ctrl-C to `callback` on the running loop, then put the previous handler back.

    `loop.remove_signal_handler` alone would reset SIGINT to `default_int_handler`, dropping the
    handler `asyncio.run` installed to cancel the main task."""
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGINT)
    # Started with Ctrl-C ignored (nohup, a background job): leave it ignored.
    installed = previous != signal.SIG_IGN
    if installed:
        try:
            loop.add_signal_handler(signal.SIGINT, callback)
        except (NotImplementedError, RuntimeError):  # no signals here (Windows, not the main thread)
            installed = False
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def _read_line(loop: asyncio.AbstractEventLoop) -> asyncio.Future[str | None]:
    """One line from stdin without blocking the loop; None at end of input."""
    future: asyncio.Future[str | None] = loop.create_future()

    def deliver(result: str | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def read() -> None:
        result: str | None = None
        error: BaseException | None = None
        try:
            result = input()
        except EOFError:
            pass
        except Exception as err:  # handed to the awaiting coroutine
            error = err
        # The loop may be gone: the session ended while this line was pending.
        with suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=read, name="dyngraph-text-input", daemon=True).start()
    return future


class _CtrlC:
    """Where Ctrl-C goes right now: quit at the prompt, stop the answer during a generation.

    One loop signal handler covers the whole session, so there is no moment between turns
    where Ctrl-C would fall through to asyncio's handler and end the process with a traceback."""

    def __init__(self) -> None:
        self.action: Callable[[], None] = lambda: None

    def __call__(self) -> None:
        self.action()


async def _prompt(console: Console, ctrl_c: _CtrlC) -> str | None:
    """The user's next message; None when they quit (Ctrl-C or Ctrl-D)."""
    interrupted = asyncio.Event()
    ctrl_c.action = interrupted.set
    console.print(PROMPT, end="")
    line = _read_line(asyncio.get_running_loop())
    waiter = asyncio.ensure_future(interrupted.wait())
    await asyncio.wait([line, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not line.done():
        line.cancel()
        return None
    return line.result()


async def _answer(
    pipeline: ModelPipeline, request: ChatCompletionRequest, ctrl_c: _CtrlC
) -> tuple[str, bool]:
    """Stream one answer to stdout, ending its line; returns the text and whether the user
    cancelled it. Raises what `prepare` or the stream raise."""
    prepared = pipeline.prepare(request)
    context = Context()
    parts: list[str] = []
    interrupts = 0

    async def consume() -> None:
        async for delta in pipeline.stream(prepared, context):
            if delta.text:
                parts.append(delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()

    task = asyncio.create_task(consume())

    def on_ctrl_c() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            context.stop_generating()
        else:  # stop waiting for the engine to wind down
            context.kill()
            task.cancel()

    ctrl_c.action = on_ctrl_c
    try:
        await task
    except asyncio.CancelledError:
        if interrupts < 2:
            raise
    except Exception:
        # A stopped engine may end its stream with an error; that was our cancel.
        if not interrupts:
            raise
    finally:
        if parts:
            sys.stdout.write("\n")
            sys.stdout.flush()
    return "".join(parts), interrupts > 0


async def run_text(pipeline: ModelPipeline, *, ignore_eos: bool) -> int:
    """The REPL; returns the process exit code (0: the user quit)."""
    ctrl_c = _CtrlC()
    with sigint_calls(ctrl_c):
        return await _chat(pipeline, ctrl_c, ignore_eos=ignore_eos)


async def _chat(pipeline: ModelPipeline, ctrl_c: _CtrlC, *, ignore_eos: bool) -> int:
    console = Console(highlight=False)
    errors = Console(stderr=True, highlight=False)
    history: list[ChatMessage] = []
    while True:
        text = await _prompt(console, ctrl_c)
        if text is None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return 0
        if not text.strip():
            continue
        messages = [*history, ChatMessage(role="user", content=text)]
        request = chat_request(pipeline, messages, ignore_eos=ignore_eos, stream=True)
        try:
            answer, cancelled = await _answer(pipeline, request, ctrl_c)
        except Exception as err:  # bad input or a failing engine: report it and keep chatting
            log.debug("request failed", exc_info=True)
            errors.print(f"[red]{escape(error_message(err))}[/]")
            continue
        if cancelled:
            errors.print("[yellow]\\[cancelled][/]")
            continue
        history = [*messages, ChatMessage(role="assistant", content=answer)]
