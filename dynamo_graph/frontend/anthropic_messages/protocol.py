"""Anthropic Messages requests as msgspec Structs: content blocks and tool choices are unions
tagged by `type`, so a wrong block is a decode error naming `messages[i].content[j]`.

Fields that change nothing here (`metadata`, `thinking`, `service_tier`, a block's
`cache_control`, ...) are accepted and ignored; a top-level field the API does not have is refused
unless the frontend is told to ignore those (`--http-unknown-fields`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from dynamo_graph.llm.openai import NvExt, PosInt, Probability


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: dict[str, Any]


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct, omit_defaults=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None


class ToolChoiceAuto(msgspec.Struct, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(msgspec.Struct, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(msgspec.Struct, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(msgspec.Struct, tag="none", tag_field="type"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


def _blocks(*kinds: dict[str, Any], shown: tuple[str, ...] = ()) -> dict[str, Any]:
    """A turn's content: text, or blocks of `kinds`, one of them `shown` (a turn of thinking
    blocks alone becomes no chat message at all)."""
    blocks: dict[str, Any] = {"type": "array", "items": {"anyOf": list(kinds)}, "minItems": 1}
    if shown:
        blocks["contains"] = {"properties": {"type": {"enum": list(shown)}}}
    return {"anyOf": [{"type": "string"}, blocks]}


def _kind(tag: str, **properties: Any) -> dict[str, Any]:
    return {"properties": {"type": {"const": tag}, **properties}}


# Which blocks serving.py takes in which turn: tool results from the user, calls and thinking
# from the assistant, text from both; no images (no engine here sees them).
TURN_BLOCKS = {
    "anyOf": [
        {
            "properties": {
                "role": {"const": "user"},
                "content": _blocks(_kind("text"), _kind("tool_result", content=_blocks(_kind("text")))),
            }
        },
        {
            "properties": {
                "role": {"const": "assistant"},
                "content": _blocks(
                    _kind("text"),
                    _kind("tool_use"),
                    _kind("thinking"),
                    _kind("redacted_thinking"),
                    shown=("text", "tool_use"),
                ),
            }
        },
    ]
}


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/messages/count_tokens`: what a message would be, without sampling options."""

    model: str
    messages: Annotated[
        list[Annotated[Message, Meta(extra_json_schema=TURN_BLOCKS)]], Meta(extra_json_schema={"minItems": 1})
    ]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # extended thinking's budget: the template decides here


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: PosInt
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    nvext: NvExt | None = None  # Dynamo's extensions, as on chat completions
