"""Tool-call parsers: a model's text -> OpenAI `content` and `tool_calls`, whole or streamed.

Chosen per model by name (`--dyn-tool-call-parser`, carried in the model deployment card);
formats.py lists the formats, stream.py does the splitting.
"""

from __future__ import annotations

from dynamo_graph.llm.tool_calls.base import ToolCallDelta
from dynamo_graph.llm.tool_calls.formats import TOOL_FORMATS, ToolFormat
from dynamo_graph.llm.tool_calls.stream import ParsedToolCalls, ToolCallStream, merge_events, parse_tool_calls

TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)

__all__ = [
    "TOOL_CALL_PARSERS",
    "TOOL_FORMATS",
    "ParsedToolCalls",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolFormat",
    "merge_events",
    "parse_tool_calls",
]
