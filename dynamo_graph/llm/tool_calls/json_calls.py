"""An incremental scanner for tool calls written as JSON objects: `{"name": ..., "arguments": ...}`.

Several model families write their calls as JSON (hermes inside `<tool_call>` tags, llama 3 after
`<|python_tag|>` or bare, mistral as an array after `[TOOL_CALLS]`). The scanner reads the text
once, character by character, keeping only a stack of open containers, so a call can be sent
while it is still being written: its name once its arguments have begun (and shown that they are
an object, so a call is not announced for `"parameters": [1]`), then the raw text of the
`arguments` (or `parameters`) value so far, which only ever grows. Arguments written as a JSON
string holding an object are handed out whole, decoded, once the string closes. Top-level
values may be objects or arrays of objects, separated by whitespace, `,` or `;` (llama 3
separates several calls with `;`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dynamo_graph.llm.tool_calls.base import CallState

ARGUMENT_KEYS = ("arguments", "parameters")
_SPACE = " \t\r\n"
_SEPARATORS = _SPACE + ",;"


@dataclass(slots=True)
class _Call:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_kind: str = ""  # "container" or "string"
    complete: bool = False
    valid: bool = True


@dataclass(slots=True)
class _Frame:
    kind: str  # "{" or "["
    expect_key: bool = True
    key: str | None = None
    value_started: bool = False
    call: _Call | None = None  # set on a call object's own frame
    args_of: _Call | None = None  # set on the frame of a call's (container) arguments value


class JsonCallsRegion:
    """Tool calls as JSON objects (see module docstring); one instance per markup region."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0
        self._stack: list[_Frame] = []
        self._calls: list[_Call] = []
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self.failed = False

    def feed(self, text: str) -> None:
        self._text += text
        if self.failed:
            return
        text, stack = self._text, self._stack
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    try:
                        self._string_end(i)
                    except ValueError:  # an escape JSON does not allow
                        self.failed = True
                        break
                continue
            if c in _SPACE:
                continue
            if not stack and c not in "{[":
                if c not in _SEPARATORS:
                    self.failed = True
                    break
                continue
            if c == '"':
                self._value_start(i, "string")
                self._in_string = True
                self._string_start = i
            elif c in "{[":
                args_of = self._value_start(i, "container")
                frame = _Frame(kind=c, expect_key=c == "{", args_of=args_of)
                if c == "{" and (not stack or (len(stack) == 1 and stack[0].kind == "[")):
                    frame.call = _Call()
                    self._calls.append(frame.call)
                stack.append(frame)
            elif c in "}]":
                if stack[-1].kind != ("{" if c == "}" else "["):
                    self.failed = True
                    break
                frame = stack.pop()
                if frame.args_of is not None:
                    frame.args_of.args_end = i + 1
                if frame.call is not None:
                    self._complete(frame.call)
            elif c == ":" and stack[-1].kind == "{":
                stack[-1].expect_key = False
            elif c == ",":
                top = stack[-1]
                top.expect_key = top.kind == "{"
                top.value_started = False
            else:
                self._value_start(i, "scalar")
        self._pos = len(text)

    def _value_start(self, i: int, kind: str) -> _Call | None:
        """A value begins at i; returns the call whose arguments it is, if it is a container."""
        if not self._stack:
            return None
        top = self._stack[-1]
        if top.value_started or (top.kind == "{" and top.expect_key):
            return None
        top.value_started = True
        call = top.call
        if call is None or top.key not in ARGUMENT_KEYS or call.args_start is not None:
            return None
        call.args_start, call.args_kind = i, kind
        if kind == "scalar" or self._text[i] == "[":  # arguments are an object (or one as a string)
            call.valid = False
        return call if kind == "container" else None

    def _string_end(self, i: int) -> None:
        if not self._stack:
            return
        top = self._stack[-1]
        raw = self._text[self._string_start : i + 1]
        if top.kind == "{" and top.expect_key:
            top.key = json.loads(raw)
            return
        call = top.call
        if call is None:
            return
        if top.key == "name" and call.name is None:
            name = json.loads(raw)
            call.name = name if isinstance(name, str) else None
        elif top.key in ARGUMENT_KEYS and call.args_kind == "string" and call.args_end is None:
            call.args_end = i + 1

    def _complete(self, call: _Call) -> None:
        call.complete = True
        if not call.valid or call.name is None:
            call.valid = False
            return
        try:
            call.valid = isinstance(json.loads(self._arguments(call)), dict)
        except ValueError:
            call.valid = False

    def _arguments(self, call: _Call) -> str:
        if call.args_start is None:
            return "{}"
        raw = self._text[call.args_start : call.args_end].strip()
        if call.args_kind == "string":
            decoded = json.loads(raw)
            return decoded if isinstance(decoded, str) else json.dumps(decoded)
        return raw

    def calls(self) -> list[CallState]:
        states = []
        for call in self._calls:
            if not call.valid:  # nothing more of it (or after it) is sent
                states.append(CallState(complete=call.complete))
                continue
            if call.complete:
                args = self._arguments(call)
            elif call.args_kind == "container":
                args = self._text[call.args_start : call.args_end]
            elif call.args_start is None:  # the name waits until the arguments show their kind
                states.append(CallState())
                continue
            else:  # strings are handed out whole, once complete
                args = ""
            states.append(CallState(name=call.name, arguments=args, complete=call.complete))
        return states

    def close(self) -> bool:
        complete = [c for c in self._calls if c.complete]
        return not self.failed and bool(complete) and all(c.valid for c in complete)
