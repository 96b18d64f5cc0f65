"""Server-sent events: what every streaming API surface shares.

Each surface's package writes its own events (`openai_chat/events.py` for chat and completions,
`openai_responses/events.py`, `anthropic_messages/events.py`, `generate_tokens/events.py`) through
the `StreamWriter` contract below; the handler's streaming loop (openai_asgi.py `_stream`) sends
them with `SSE_HEADERS` once the first delta is known, so a failure before it is still a plain
JSON error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dynamo_graph.frontend.errors import HTTPError
    from dynamo_graph.llm.pipeline import Delta

SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each event on, do not buffer the stream
]
DONE = b"data: [DONE]\n\n"  # the last event of an OpenAI-shaped stream


class StreamWriter(Protocol):
    """One streamed response's bytes, in the order the handler sends them; every API surface
    (chat, completions, Responses, Messages, token-in/token-out) has one."""

    def start(self) -> bytes:
        """Events before the first delta ("" for none)."""

    def delta(self, delta: Delta) -> bytes:
        """A visible delta's events."""

    def finish(self, reason: str) -> bytes:
        """The closing events, after the delta with the finish reason."""

    def failure(self, err: HTTPError) -> bytes:
        """The closing events when the stream fails after it started."""


def error_event(err: HTTPError) -> bytes:
    """An OpenAI-shaped stream's closing events when it fails after it started: OpenAI clients
    raise on a data event with `error`."""
    return b"data: " + err.body() + b"\n\n" + DONE
