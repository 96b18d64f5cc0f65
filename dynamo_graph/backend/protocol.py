"""The wire types of the engine contract, where engine authors look for them.

They live in llm/protocol.py, the lowest room that uses them (the preprocessor builds a
`PreprocessedRequest`, the postprocessor reads `LLMEngineOutput`s, migration rewrites both).
"""

from __future__ import annotations

from dynamo_graph.llm.protocol import (
    CompletionUsage,
    FinishReason,
    KvImportReport,
    KvTransferParams,
    LLMEngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    TopLogprob,
    request_priority,
)

__all__ = [
    "CompletionUsage",
    "FinishReason",
    "KvImportReport",
    "KvTransferParams",
    "LLMEngineOutput",
    "OutputOptions",
    "PreprocessedRequest",
    "SamplingOptions",
    "StopConditions",
    "TopLogprob",
    "request_priority",
]
