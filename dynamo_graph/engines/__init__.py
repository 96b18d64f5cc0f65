"""Engines by their `out=` name: the records are registry.py's; this builds them. Each engine is
imported lazily so heavy optional packages load only when that engine is chosen."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.engines.registry import (
    DEFAULT_ENGINE_ORDER,
    EMBEDDING_ENGINES,
    ENGINE_PACKAGES,
    ENGINES,
    FILE_ENGINES,
    EngineSpec,
)

if TYPE_CHECKING:
    from dynamo_graph.backend.engine import LLMEngine
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

__all__ = [
    "ENGINES",
    "ENGINE_PACKAGES",
    "EngineSpec",
    "UnknownEngineError",
    "create_engine",
    "default_engine",
    "engine_names",
    "get_engine_spec",
]


class UnknownEngineError(RunConfigError):
    """`out=` names no engine: reported like any bad flag."""


def engine_names() -> list[str]:
    return sorted(ENGINES)


def get_engine_spec(name: str) -> EngineSpec:
    spec = ENGINES.get(name)
    if spec is not None:
        return spec
    kind, sep, path = name.partition(":")
    if kind in ("pystr", "pytok"):
        if not sep or not path:
            raise UnknownEngineError(f"out={kind} needs a python file: out={kind}:FILE")
        return FILE_ENGINES[kind]
    if name.endswith(".py"):
        return FILE_ENGINES[".py"]
    available = ", ".join(f"{n} ({ENGINES[n].description})" for n in engine_names())
    available += "; " + "; ".join(spec.description for spec in FILE_ENGINES.values())
    raise UnknownEngineError(
        f"unknown engine {name!r}; available engines: {available} (or a dyn://namespace.component.endpoint)"
    )


def create_engine(name: str, cfg: EngineSettings, model: LocalModel | None) -> LLMEngine:
    spec = get_engine_spec(name)
    target = spec.target
    if cfg.embedding:
        if spec.embedding_target is None:
            able = ", ".join(EMBEDDING_ENGINES)
            raise RunConfigError(
                f"--embedding: engine {name!r} cannot compute embeddings (engines that can: {able})"
            )
        target = spec.embedding_target
    elif spec.from_file:
        from dynamo_graph.engines.pyfile import create_file_engine

        return create_file_engine(name, cfg, model)
    module_name, _, attr = target.partition(":")
    engine_class: type[LLMEngine] = getattr(importlib.import_module(module_name), attr)
    return engine_class.from_config(cfg, model)


def default_engine() -> str:
    """dynamo-run's default: the first of DEFAULT_ENGINE_ORDER whose package is installed."""
    for name in DEFAULT_ENGINE_ORDER:
        if name in ENGINES and importlib.util.find_spec(ENGINE_PACKAGES[name]) is not None:
            return name
    raise UnknownEngineError(
        "no inference engine is installed for `dyngraph run MODEL` (tried, in order: "
        f"{', '.join(DEFAULT_ENGINE_ORDER)}); choose one with out=ENGINE, e.g. out=echo_core"
    )
