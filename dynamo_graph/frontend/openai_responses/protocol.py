"""The Responses API's request, as msgspec Structs.

`input` items stay plain objects: an easy input message has no `type`, so no tagged union fits,
and serving.py checks each item's fields itself, naming them as `input[i].field`. Fields that
change nothing here (`include`, `reasoning`, `truncation`, `user`, ...) are declared, accepted and
ignored; those that would need state or tools we do not run are refused in serving.py; any other
is refused unless the frontend is told to ignore those (`--http-unknown-fields`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from dynamo_graph.llm.openai import BookkeepingFields, NvExt, PosInt, Probability, Temperature


class FunctionTool(msgspec.Struct, omit_defaults=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct):
    type: Literal["function"]
    name: str


class TextConfig(msgspec.Struct, omit_defaults=True):
    # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", ...}
    format: dict[str, Any] | None = None


_TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}},
        "required": ["type", "text"],
    },
}
_CONTENT = {"anyOf": [{"type": "string"}, _TEXT_PARTS]}
_STRING = {"type": "string"}
_REASONING = {"type": "object", "properties": {"type": {"const": "reasoning"}}, "required": ["type"]}
# The items serving.py turns into chat messages (earlier reasoning is dropped, so some other item
# must be there); images and hosted tools' items are refused.
INPUT_ITEMS = {
    "type": "array",
    "minItems": 1,
    "contains": {"not": _REASONING},
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "type": {"const": "message"},
                    "role": {"enum": ["user", "system", "developer", "assistant"]},
                    "content": _CONTENT,
                },
                "required": ["role", "content"],
            },
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function_call"},
                    "call_id": _STRING,
                    "name": _STRING,
                    "arguments": _STRING,
                },
                "required": ["type", "call_id", "name", "arguments"],
            },
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function_call_output"},
                    "call_id": _STRING,
                    "output": _CONTENT,
                },
                "required": ["type", "call_id", "output"],
            },
            _REASONING,
        ]
    },
}
# Stored responses are not kept here: these must be left out (or null, or false).
_STATELESS = Meta(extra_json_schema={"not": {}})


class ResponsesRequest(BookkeepingFields, omit_defaults=True, kw_only=True):
    model: str
    input: Annotated[
        str | list[dict[str, Any]], Meta(extra_json_schema={"allOf": [{"anyOf": [_STRING, INPUT_ITEMS]}]})
    ]
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: Annotated[str, _STATELESS] | None = None
    conversation: Annotated[Any, Meta(extra_json_schema={"type": "null"})] = None
    background: Annotated[bool, Meta(extra_json_schema={"const": False})] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    nvext: NvExt | None = None  # Dynamo's extensions, as on chat completions
