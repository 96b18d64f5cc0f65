"""The real engines (llama.cpp, mistral.rs) on the tiny model against the conformance kit.
Each is skipped when its package is missing, except under CI (env CI set), where it must be there."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dynamo_graph.backend.conformance import CHECKS, check_engine
from dynamo_graph.backend.engine import LLMEngine
from dynamo_graph.backend.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.llm.model_source import LocalModel, resolve_model

PROMPT = "The quick brown fox jumps over the lazy dog."


def _require(package: str) -> None:
    if os.environ.get("CI"):
        importlib.import_module(package)  # CI installs the extras: missing must fail, not skip
    else:
        pytest.importorskip(package)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> LocalModel:
    return resolve_model(str(tiny_model))


@pytest.fixture(scope="module")
def make_request(model: LocalModel) -> Callable[[int], PreprocessedRequest]:
    ids = model.load_tokenizer().encode(PROMPT).ids

    def make(max_tokens: int) -> PreprocessedRequest:
        return PreprocessedRequest(
            model="tiny",
            token_ids=list(ids),
            stop_conditions=StopConditions(max_tokens=max_tokens),
            sampling_options=SamplingOptions(temperature=0.0),
            eos_token_ids=list(model.eos_token_ids),
        )

    return make


def _llamacpp(tiny_model: Path, model: LocalModel) -> Callable[[], LLMEngine]:
    from dynamo_graph.engines.llamacpp.args import LlamaCppArgs
    from dynamo_graph.engines.llamacpp.engine import LlamaCppEngine

    vocab = model.load_tokenizer().get_vocab_size(with_added_tokens=True)
    return lambda: LlamaCppEngine(
        tiny_model / GGUF_NAME,
        LlamaCppArgs.from_dict({"n_parallel": 2}),
        default_n_ctx=512,
        tokenizer_vocab_size=vocab,
    )


def _mistralrs(tiny_model: Path, model: LocalModel) -> Callable[[], LLMEngine]:
    from dynamo_graph.engines.mistralrs.args import MistralrsArgs
    from dynamo_graph.engines.mistralrs.engine import MistralrsEngine

    return lambda: MistralrsEngine(model, MistralrsArgs(max_seqs=4))


ENGINES: dict[str, tuple[str, Callable[[Path, LocalModel], Callable[[], LLMEngine]]]] = {
    "llamacpp": ("llama_cpp", _llamacpp),
    "mistralrs": ("mistralrs", _mistralrs),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_real_engine_conforms(
    engine: str, check: str, tiny_model: Path, model: LocalModel, make_request: Any
) -> None:
    package, factory = ENGINES[engine]
    _require(package)
    report = await check_engine(
        factory(tiny_model, model), make_request, only=[check], concurrency=4, cancel_max_tokens=200
    )
    assert report.passed == [check]
