"""Reading one streamed response: what the client sees of a request (`Result`), from the HTTP
status line to the last SSE event.

The body is read in whatever blocks the socket holds and de-chunked in one pass; each SSE event
is decoded once by msgspec into the few fields read here (output, usage, errors) of the OpenAI
chat and completions streams, the Responses API's and Anthropic's Messages API's. A burst of
tokens that arrives in one read shares one timestamp: the client saw them at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec


@dataclass
class Result:
    """What the client saw of one request. Times are seconds; `start` counts from the run's start."""

    index: int
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    total: float = 0.0
    tokens: int = 0  # streamed events that carried output (text, reasoning or a tool call)
    output_tokens: int = 0  # the usage's completion tokens; `tokens` when the server sends none
    prompt_tokens: int = 0
    cached_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between output events: ITL


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: msgspec.Raw | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Event(msgspec.Struct):
    """The fields of a streamed event that the client reads (OpenAI chat and completions, the
    Responses API, Anthropic's Messages API); the rest is skipped unparsed."""

    choices: list[_Choice] | None = None
    usage: dict | None = None
    response: dict | None = None  # Responses: response.completed carries the usage
    error: msgspec.Raw | None = None
    type: str | None = None


_decode_event = msgspec.json.Decoder(_Event).decode
_OUTPUT_TYPES = ("response.output_text.delta", "content_block_delta")


def _output_in(event: _Event) -> bool:
    """Does this streamed event carry generated output?"""
    if event.choices:
        choice = event.choices[0]
        if choice.text:
            return True
        delta = choice.delta
        return delta is not None and bool(delta.content or delta.reasoning_content or delta.tool_calls)
    return event.type in _OUTPUT_TYPES


def _read_usage(event: _Event, result: Result) -> None:
    usage = event.usage or (event.response or {}).get("usage")
    if not usage:
        return
    result.output_tokens = usage.get("completion_tokens") or usage.get("output_tokens") or 0
    result.prompt_tokens = usage.get("prompt_tokens") or usage.get("input_tokens") or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens") or 0


def _handle_events(buf: bytes, now: float, start: float, last: list[float], result: Result) -> bytes:
    """Consume the complete SSE events in `buf`; returns the incomplete rest."""
    events = buf.split(b"\n\n")
    for raw in events[:-1]:
        data_at = raw.find(b"data: ")
        if data_at < 0 or raw.endswith(b"[DONE]"):
            continue
        data = raw[data_at + 6 :]
        if not data.startswith(b"{"):
            continue
        event = _decode_event(data)
        if event.error is not None or event.type == "error":
            result.error = bytes(event.error or data)[:300].decode(errors="replace")
        if _output_in(event):
            if last:
                result.gaps.append(now - last[0])
                last[0] = now
            else:
                result.ttft = now - start
                last.append(now)
            result.tokens += 1
        if event.usage or event.response:
            _read_usage(event, result)
    return events[-1]


class _Chunked:
    """De-chunks an HTTP/1.1 chunked body from whatever blocks the socket hands over, so that one
    read of many small chunks (a burst of tokens) costs one pass, not two awaits per chunk."""

    def __init__(self) -> None:
        self.raw = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The body bytes complete in `raw + data`; sets `done` at the last (empty) chunk."""
        raw = self.raw + data
        out = []
        pos = 0
        while True:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";", 1)[0], 16)
            end = eol + 2 + size + 2
            if size == 0:
                if raw.find(b"\r\n", eol + 2) < 0:  # the trailer's blank line has not come yet
                    break
                self.done = True
                pos = len(raw)
                break
            if end > len(raw):
                break
            out.append(raw[eol + 2 : end - 2])
            pos = end
        self.raw = raw[pos:]
        return b"".join(out)


async def read_response(reader: asyncio.StreamReader, start: float, result: Result) -> bool:
    """Read one response; returns whether the connection can carry another request."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    headers = head.lower()
    reusable = b"connection: close" not in headers
    if b"transfer-encoding: chunked" not in headers:
        length = 0
        for line in headers.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        if status != b"200":
            result.error = f"HTTP {status.decode()}: {body[:300].decode(errors='replace')}"
        else:  # a 200 that is not a stream: the server ignored "stream"
            result.error = "the response was not streamed"
        return reusable
    buf = b""
    last: list[float] = []
    chunked = _Chunked()
    while not chunked.done:
        data = await reader.read(65536)
        if not data:
            raise asyncio.IncompleteReadError(chunked.raw, None)
        buf += chunked.feed(data)
        if status == b"200":
            buf = _handle_events(buf, time.perf_counter(), start, last, result)
    if status != b"200":
        result.error = f"HTTP {status.decode()}: {buf[:300].decode(errors='replace')}"
    if not result.output_tokens:
        result.output_tokens = result.tokens
    result.ok = not result.error and result.tokens > 0
    if not result.ok and not result.error:
        result.error = "no output in the stream"
    return reusable
