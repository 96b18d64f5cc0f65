"""Reasoning parsers: a thinking model's output -> `reasoning_content` and `content`, incrementally.

Chosen per model by name (`--dyn-reasoning-parser`, carried in the model deployment card), as
in vLLM and Dynamo:

- deepseek_r1: the output starts in reasoning (the chat template already opened `<think>`; a
  `<think>` the model writes anyway is dropped) and `</think>` switches to the answer. An output
  that never closes its thinking is all reasoning.
- qwen3: reasoning only inside a `<think>...</think>` at the start of the output; an output that
  does not open with `<think>` is all answer (Qwen 3 with thinking switched off).

The markers never reach either field, however the text is split: a tail that could still be the
start of a marker is held back until it cannot. Whitespace between `</think>` and the answer is
dropped. Token counts are not affected: this only sorts text.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_graph.llm.tool_calls.formats import held_suffix

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_in_reasoning: bool


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f for f in (ReasoningFormat("deepseek_r1", True), ReasoningFormat("qwen3", False))
}
REASONING_PARSERS = tuple(REASONING_FORMATS)


class ReasoningStream:
    """Feed text pieces; get (reasoning, content) pieces back."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._fmt = fmt
        self._state = "start"  # "start" -> "reasoning" -> "answer_start" -> "answer"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        reasoning = ""
        while buf:
            if self._state == "start":
                stripped = buf.lstrip()
                if THINK_START.startswith(stripped):  # whitespace, or a start of `<think>`
                    self._held = buf
                    return reasoning, ""
                if stripped.startswith(THINK_START):
                    buf = stripped[len(THINK_START) :]
                    self._state = "reasoning"
                else:
                    self._state = "reasoning" if self._fmt.starts_in_reasoning else "answer"
            elif self._state == "reasoning":
                at = buf.find(THINK_END)
                if at == -1:
                    keep = held_suffix(buf, THINK_END)
                    self._held = buf[len(buf) - keep :]
                    return reasoning + buf[: len(buf) - keep], ""
                reasoning += buf[:at]
                buf = buf[at + len(THINK_END) :]
                self._state = "answer_start"
            elif self._state == "answer_start":
                buf = buf.lstrip()
                if buf:
                    self._state = "answer"
            else:
                return reasoning, buf
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back, sorted."""
        held, self._held = self._held, ""
        if self._state == "start":
            return ("", held) if not self._fmt.starts_in_reasoning else (held, "")
        if self._state == "reasoning":
            return held, ""
        return "", held


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    stream = ReasoningStream(fmt)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return r1 + r2, c1 + c2
