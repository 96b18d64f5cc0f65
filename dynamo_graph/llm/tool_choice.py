"""tool_choice "required" or a named function: the call is forced by guided decoding.

As vLLM does it: the model is not asked for its own tool-call markup; its output is constrained
to plain JSON that can only be the call(s) asked for, so no parser has to find them.

- a named function: the output is that function's arguments object (its `parameters` schema);
  the call's id and name are sent first, then the output itself as argument deltas.
- "required": the output is a JSON array of one or more `{"name": ..., "parameters": {...}}`
  objects, each naming one of the offered tools with arguments matching its schema (at most one
  when `parallel_tool_calls` is false); read with the JSON call scanner, so arguments stream as
  they are written.

Only engines that honour `guided_json` can do this; the pipeline answers 400 for the others.
"""

from __future__ import annotations

from typing import Any

from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.preprocessor import TOOL_CHOICE_WITHOUT_TOOL, RequestValidationError
from dynamo_graph.llm.tool_calls import ToolCallDelta, ToolCallStream, ToolFormat
from dynamo_graph.llm.tool_calls.json_calls import JsonCallsRegion
from dynamo_graph.llm.tool_calls.stream import Event, new_call_id

REQUIRED_FORMAT = ToolFormat("required", JsonCallsRegion, leading="[")


def forced(request: ChatCompletionRequest) -> bool:
    """Whether tool_choice forces a call ("required" or a named function)."""
    choice = request.tool_choice
    return choice is not None and choice not in ("auto", "none")


def _functions(request: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """Offered function name -> its parameters schema."""
    functions = {}
    for tool in request.tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            functions[function["name"]] = params if isinstance(params, dict) else {"type": "object"}
    return functions


def named_function(request: ChatCompletionRequest) -> str | None:
    """The function a named tool_choice asks for; None for "required". Raises on a bad choice."""
    choice = request.tool_choice
    if choice == "required":
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestValidationError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in _functions(request):
        raise RequestValidationError(
            f"tool_choice names function {name!r}, which is not in tools",
            "tool_choice",
            TOOL_CHOICE_WITHOUT_TOOL,
        )
    return name


def forced_schema(request: ChatCompletionRequest) -> dict[str, Any]:
    """The JSON schema the output must follow for the forced call(s)."""
    functions = _functions(request)
    if not functions:
        raise RequestValidationError(
            "tool_choice needs tools with function names", "tool_choice", TOOL_CHOICE_WITHOUT_TOOL
        )
    name = named_function(request)
    if name is not None:
        return functions[name]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [fname]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for fname, params in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


class NamedCallStream:
    """The output is the arguments of one call to `name`: same interface as ToolCallStream."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls_made = 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.calls_made == 0:
            self.calls_made = 1
            out.append(ToolCallDelta(index=0, id=new_call_id(), name=self._name))
        if text:
            out.append(ToolCallDelta(index=0, arguments=text))
        return out

    def finish(self) -> list[Event]:
        return self.feed("") if self.calls_made == 0 else []


def forced_stream(request: ChatCompletionRequest) -> NamedCallStream | ToolCallStream:
    name = named_function(request)
    return ToolCallStream(REQUIRED_FORMAT) if name is None else NamedCallStream(name)
