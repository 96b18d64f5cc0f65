"""What every tool-call format shares: the state of a call being read, and the deltas sent out.

A format's region parser reads the text inside one markup region (between `<tool_call>` and
`</tool_call>`, after `[TOOL_CALLS]`, ...) and reports the calls it has seen so far as
`CallState`s. A call's `arguments` only ever grow from one report to the next, so the stream can
send the new part as an OpenAI argument delta (stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class CallState:
    name: str | None = None
    # The argument text known so far: a prefix of the final arguments (a JSON object as text).
    arguments: str = ""
    complete: bool = False


class Region(Protocol):
    def feed(self, text: str) -> None:
        """More text of the region."""

    def calls(self) -> list[CallState]:
        """The calls seen so far, in order."""

    def close(self) -> bool:
        """The region ended: True when it held one or more well-formed calls and nothing else."""


@dataclass(slots=True)
class ToolCallDelta:
    """One OpenAI streamed tool-call delta: the first for a call has id and name, later ones
    append to its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out
