"""Splits a model's output into content and OpenAI tool-call deltas, incrementally.

Text arrives in pieces split anywhere (mid-marker, mid-character-name, mid-JSON). Content is
sent as soon as it cannot be the start of a call's markup: a tail that could still become a
start marker is held back, as is whitespace at the start of an output whose format opens with a
leading character. Inside a region, the format's parser reports calls; each call is sent as
OpenAI streams them (a first delta with index, id and name, then argument deltas), and the
markup never reaches the content. A region that turns out not to hold well-formed calls, with
nothing of it sent yet, is sent back as content: the model's text is never lost.

The same object does non-streaming parsing (`parse_tool_calls`): feed the whole text, finish,
merge the deltas; so both modes agree by construction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from dynamo_graph.llm.tool_calls.base import Region, ToolCallDelta
from dynamo_graph.llm.tool_calls.formats import ToolFormat, held_suffix

Event = str | ToolCallDelta  # content text, or a tool-call delta


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class _Open:
    """A region being read, and what of its calls has been sent."""

    region: Region
    raw: str  # the region's text with its start marker, for the fallback to content
    base: int  # the OpenAI index of its first call
    sent: list[tuple[bool, int]] = field(default_factory=list)  # per call: name sent, args length


class ToolCallStream:
    def __init__(self, fmt: ToolFormat) -> None:
        self._fmt = fmt
        self._held = ""
        self._at_start = fmt.leading is not None
        self._open: _Open | None = None
        self._after_region = False
        self.calls_made = 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        buf = self._held + text
        self._held = ""
        fmt = self._fmt
        while buf:
            if self._open is not None:
                end = fmt.end
                at = buf.find(end) if end else -1
                if at == -1:
                    keep = held_suffix(buf, end) if end else 0
                    self._region_feed(buf[: len(buf) - keep], out)
                    self._held = buf[len(buf) - keep :]
                    return out
                self._region_feed(buf[:at], out)
                self._close_region(out, end or "")
                buf = buf[at + len(end or "") :]
                continue
            if self._at_start:
                stripped = buf.lstrip()
                if not stripped:
                    self._held = buf
                    return out
                self._at_start = False
                if fmt.leading is not None and stripped.startswith(fmt.leading):
                    self._open_region("")
                    buf = stripped
                    continue
            first, marker = -1, ""
            for m in fmt.start:
                at = buf.find(m)
                if at != -1 and (first == -1 or at < first):
                    first, marker = at, m
            if first == -1:
                keep = max((held_suffix(buf, m) for m in fmt.start), default=0)
                self._content(buf[: len(buf) - keep], out)
                self._held = buf[len(buf) - keep :]
                return out
            self._content(buf[:first], out)
            self._open_region(marker)
            buf = buf[first + len(marker) :]
        return out

    def finish(self) -> list[Event]:
        """The output ended: close an open region, send what was held back."""
        out: list[Event] = []
        held, self._held = self._held, ""
        if self._open is not None:
            self._region_feed(held, out)
            self._close_region(out, "")
        elif held:
            self._content(held, out)
        return out

    def _content(self, text: str, out: list[Event]) -> None:
        if self._after_region:  # whitespace between and after calls is not content
            text = text.lstrip()
            if not text:
                return
            self._after_region = False
        if text:
            out.append(text)

    def _open_region(self, marker: str) -> None:
        self._open = _Open(region=self._fmt.region(), raw=marker, base=self.calls_made)

    def _region_feed(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        state = self._open
        assert state is not None
        state.raw += text
        state.region.feed(text)
        self._send_calls(state, out)

    def _send_calls(self, state: _Open, out: list[Event]) -> None:
        sent = state.sent
        for i, call in enumerate(state.region.calls()):
            if call.name is None:
                break  # a call's deltas wait for its name, and later calls for earlier ones
            if i == len(sent):
                sent.append((True, 0))
                self.calls_made = state.base + i + 1
                out.append(ToolCallDelta(index=state.base + i, id=new_call_id(), name=call.name))
            args_sent = sent[i][1]
            if len(call.arguments) > args_sent:
                out.append(ToolCallDelta(index=state.base + i, arguments=call.arguments[args_sent:]))
                sent[i] = (True, len(call.arguments))

    def _close_region(self, out: list[Event], end_marker: str) -> None:
        state = self._open
        assert state is not None
        self._open = None
        ok = state.region.close()
        self._send_calls(state, out)
        if not ok and not state.sent:
            self._content(state.raw + end_marker, out)
            return
        self._after_region = True


@dataclass(slots=True)
class ParsedToolCalls:
    content: str
    tool_calls: list[dict]


def merge_events(events: list[Event]) -> ParsedToolCalls:
    """Streamed events as one message: content, and OpenAI `tool_calls` objects."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    for ev in events:
        if isinstance(ev, str):
            content.append(ev)
        elif ev.id is not None:
            calls[ev.index] = {
                "id": ev.id,
                "type": "function",
                "function": {"name": ev.name, "arguments": ev.arguments},
            }
        else:
            calls[ev.index]["function"]["arguments"] += ev.arguments
    return ParsedToolCalls("".join(content), [calls[i] for i in sorted(calls)])


def parse_tool_calls(fmt: ToolFormat, text: str) -> ParsedToolCalls:
    stream = ToolCallStream(fmt)
    return merge_events(stream.feed(text) + stream.finish())
