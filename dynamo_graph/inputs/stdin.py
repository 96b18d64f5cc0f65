"""`in=stdin`: one prompt piped in, one answer out, for scripts (`echo "..." | dyngraph run`).

The answer streams to stdout as it is generated and ends with a newline; errors go to stderr,
so stdout holds nothing but the answer. Exit codes: 0 answered, 2 bad input (empty prompt or a
request the pipeline rejects), 1 the engine failed, 130 interrupted with Ctrl-C.
"""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.markup import escape

from dynamo_graph.inputs.text import chat_request, error_message, is_bad_request, sigint_calls
from dynamo_graph.llm.openai import ChatMessage
from dynamo_graph.llm.pipeline import ModelPipeline
from dynamo_graph.runtime.context import Context

log = logging.getLogger(__name__)


async def run_stdin(pipeline: ModelPipeline, text: str, *, ignore_eos: bool) -> int:
    """Answer `text` (the whole of stdin, as one user message); returns the exit code."""
    errors = Console(stderr=True, highlight=False)
    prompt = text.rstrip("\r\n")
    if not prompt.strip():
        errors.print("[red]in=stdin: no prompt on standard input[/]")
        return 2
    messages = [ChatMessage(role="user", content=prompt)]
    request = chat_request(pipeline, messages, ignore_eos=ignore_eos, stream=True)
    context = Context()
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        context.stop_generating()

    failure: Exception | None = None
    try:
        prepared = pipeline.prepare(request)
        with sigint_calls(on_sigint):
            async for delta in pipeline.stream(prepared, context):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
    except Exception as err:
        failure = err
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupted:
        return 130  # a stopped engine may also end its stream with an error: that was us
    if failure is None:
        return 0
    log.debug("request failed", exc_info=failure)
    errors.print(f"[red]{escape(error_message(failure))}[/]")
    return 2 if is_bad_request(failure) else 1
