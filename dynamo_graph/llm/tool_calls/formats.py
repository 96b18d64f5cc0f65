"""The tool-call formats we read, and the region parsers that are not plain JSON.

Each format says where its calls are: between start and end markers (hermes, deepseek_v3), from
a start marker to the end of the output (mistral, llama3_json after `<|python_tag|>`), or when
the output itself begins with a given character (llama3_json's bare `{`, pythonic's `[`).
Names and formats follow vLLM's and Dynamo's parsers of the same names:

- hermes: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number of them
  (Hermes, Qwen 2.5 / Qwen 3).
- llama3_json: `{"name": "f", "parameters": {...}}`, several separated by `;`, at the start of
  the output or after `<|python_tag|>` (Llama 3.1 / 3.2 JSON tool calling).
- mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (Mistral's pre-v11 format).
- pythonic: `[f(a=1), g(b="x")]` as the whole output (Llama 3.2 / 4 pythonic, ToolACE);
  arguments must be Python literals.
- deepseek_v3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f` then the
  arguments in a ```json fence, `<｜tool▁call▁end｜>`, ..., `<｜tool▁calls▁end｜>` (DeepSeek V3
  and R1-0528, the reasoning-model format).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass

from dynamo_graph.llm.tool_calls.base import CallState, Region
from dynamo_graph.llm.tool_calls.json_calls import JsonCallsRegion


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class PythonicRegion:
    """`[f(a=1), g(b="x")]`: read whole once the list closes (Python's own parser decides)."""

    def __init__(self) -> None:
        self._text = ""
        self._calls: list[CallState] | None = None

    def feed(self, text: str) -> None:
        self._text += text
        if "]" in text:
            self._calls = _pythonic_calls(self._text)

    def calls(self) -> list[CallState]:
        return self._calls or []

    def close(self) -> bool:
        return bool(self._calls)


def _pythonic_calls(text: str) -> list[CallState] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name | ast.Attribute):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        name = ast.unparse(node.func)
        calls.append(CallState(name=name, arguments=json.dumps(args, ensure_ascii=False), complete=True))
    return calls


DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
DS_FENCE_OPEN = "```json\n"
DS_FENCE_CLOSE = "\n```"


class DeepSeekV3Region:
    """The calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`; each call's text is
    re-read as it grows (calls are short, and str.find does the scanning)."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, text: str) -> None:
        self._text += text

    def _blocks(self) -> list[tuple[str, bool]]:
        blocks = []
        text = self._text
        at = text.find(DS_CALL_BEGIN)
        while at != -1:
            body_start = at + len(DS_CALL_BEGIN)
            end = text.find(DS_CALL_END, body_start)
            if end == -1:
                blocks.append((text[body_start:], False))
                break
            blocks.append((text[body_start:end], True))
            at = text.find(DS_CALL_BEGIN, end + len(DS_CALL_END))
        return blocks

    def calls(self) -> list[CallState]:
        return [_deepseek_call(body, complete) for body, complete in self._blocks()]

    def close(self) -> bool:
        calls = self.calls()
        complete = [c for c in calls if c.complete]
        return bool(complete) and all(c.name and c.arguments for c in complete)


def _deepseek_call(body: str, complete: bool) -> CallState:
    sep = body.find(DS_SEP)
    if sep == -1:
        return CallState(complete=complete)
    rest = body[sep + len(DS_SEP) :]
    newline = rest.find("\n")
    if newline == -1:
        return CallState(complete=complete)
    name = rest[:newline].strip()
    fence = rest.find(DS_FENCE_OPEN, newline)
    if fence == -1:
        return CallState(name=name, complete=complete)
    args = rest[fence + len(DS_FENCE_OPEN) :]
    close = args.find(DS_FENCE_CLOSE)
    if close != -1:
        args = args[:close]
    elif not complete:
        args = args[: len(args) - held_suffix(args, DS_FENCE_CLOSE)]
    if not complete:
        return CallState(name=name, arguments=args)
    try:
        ok = isinstance(json.loads(args), dict)
    except ValueError:
        ok = False
    return CallState(name=name, arguments=args if ok else "", complete=True)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    region: Callable[[], Region]
    start: tuple[str, ...] = ()  # markers that open a region (not part of it)
    end: str | None = None  # the marker that closes a region; None: it runs to the end
    leading: str | None = None  # opens a region (and is part of it) when the output starts with it


TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat("hermes", JsonCallsRegion, start=("<tool_call>",), end="</tool_call>"),
        ToolFormat("llama3_json", JsonCallsRegion, start=("<|python_tag|>",), leading="{"),
        ToolFormat("mistral", JsonCallsRegion, start=("[TOOL_CALLS]",)),
        ToolFormat("pythonic", PythonicRegion, leading="["),
        ToolFormat(
            "deepseek_v3", DeepSeekV3Region, start=("<｜tool▁calls▁begin｜>",), end="<｜tool▁calls▁end｜>"
        ),
    )
}
