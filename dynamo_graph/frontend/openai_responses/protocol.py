"""The Responses API's request, as msgspec Structs.

`input` items stay plain objects: an easy input message has no `type`, so no tagged union fits,
and serving.py checks each item's fields itself, naming them as `input[i].field`. Fields that
change nothing here (`include`, `reasoning`, `truncation`, `user`, ...) are accepted and ignored;
those that would need state or tools we do not run are refused in serving.py.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from dynamo_graph.llm.openai import NvExt, PosInt, Probability, Temperature


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


class ResponsesRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    nvext: NvExt | None = None  # Dynamo's extensions, as on chat completions
