"""A chat response's text sorted into OpenAI's message fields: reasoning, content, tool calls.

The model's visible text (after stop strings, postprocessor.py) goes through the model's
reasoning parser (reasoning.py) and then, for requests that offer tools, its tool-call parser
(tool_calls/): reasoning first, since thinking models write their calls in the answer. Both are
named in the model deployment card, so every frontend sorts a model's output the same way, and
both run on text, so they serve tokens-input and text-input engines alike. Each delta coming out
carries exactly one kind of text, in the order the model wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.logprobs import TokenLogprob
from dynamo_graph.llm.openai import AnyRequest, ChatCompletionRequest
from dynamo_graph.llm.reasoning import REASONING_FORMATS, ReasoningStream
from dynamo_graph.llm.tool_calls import TOOL_FORMATS, ToolCallDelta, ToolCallStream
from dynamo_graph.llm.tool_choice import NamedCallStream, forced, forced_stream


@dataclass(slots=True)
class Delta:
    """A piece of a response: content `text`, or `reasoning`, or one `tool_call` delta; the last
    delta of a stream carries the finish reason. `logprobs`: of the tokens this delta's text
    came from, when the request asked for them."""

    text: str
    finish_reason: str | None = None
    reasoning: str = ""
    tool_call: ToolCallDelta | None = None
    logprobs: list[TokenLogprob] | None = None

    def visible(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_call is not None or self.logprobs)


class ChatOutputParser:
    """One request's output: `feed` each text piece, `finish` when the engine is done."""

    __slots__ = ("_reasoning", "_tools")

    def __init__(
        self, reasoning: ReasoningStream | None, tools: ToolCallStream | NamedCallStream | None
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def made_tool_calls(self) -> bool:
        return self._tools is not None and self._tools.calls_made > 0

    def feed(self, text: str) -> list[Delta]:
        if self._reasoning is None:
            return self._content(text, final=False)
        reasoning, content = self._reasoning.feed(text)
        return self._sorted(reasoning, content, final=False)

    def finish(self) -> list[Delta]:
        if self._reasoning is None:
            return self._content("", final=True)
        reasoning, content = self._reasoning.finish()
        return self._sorted(reasoning, content, final=True)

    def _sorted(self, reasoning: str, content: str, final: bool) -> list[Delta]:
        out = [Delta("", reasoning=reasoning)] if reasoning else []
        out.extend(self._content(content, final))
        return out

    def _content(self, text: str, final: bool) -> list[Delta]:
        tools = self._tools
        if tools is None:
            return [Delta(text)] if text else []
        events = tools.feed(text) if text else []
        if final:
            events += tools.finish()
        return [Delta(ev) if isinstance(ev, str) else Delta("", tool_call=ev) for ev in events]


def wants_tool_parsing(request: ChatCompletionRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def output_parser(card: ModelDeploymentCard, request: AnyRequest) -> ChatOutputParser | None:
    """The parser a chat request's output needs under this model's card, or None. A forced
    tool_choice constrains the whole output to JSON calls (tool_choice.py): no thinking then."""
    if not isinstance(request, ChatCompletionRequest):
        return None
    if forced(request):
        return ChatOutputParser(None, forced_stream(request))
    reasoning: ReasoningStream | None = None
    tools: ToolCallStream | NamedCallStream | None = None
    if card.reasoning_parser is not None:
        reasoning = ReasoningStream(REASONING_FORMATS[card.reasoning_parser])
    if card.tool_call_parser is not None and wants_tool_parsing(request):
        tools = ToolCallStream(TOOL_FORMATS[card.tool_call_parser])
    if reasoning is None and tools is None:
        return None
    return ChatOutputParser(reasoning, tools)
