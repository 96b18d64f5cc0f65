"""LLM-level pieces: model cards and resolution, pre/post-processing, `register_llm`."""

from __future__ import annotations

from typing import Any

_EXPORTS = {"register_llm", "ModelType", "ModelInput"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dynamo_graph.llm' has no attribute {name!r}")
    from dynamo_graph.llm import register

    return getattr(register, name)
