"""engines/registry.py against the engines themselves: each record's capabilities are what its
engine class says (every engine module imports without its library)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from dynamo_graph.backend.engine import LLMEngine
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines import create_engine, registry
from tests.support.engine_adapters import tiny_local_model

# A real value for each record's connector argument (the record's example is prose for people).
CONNECTOR_VALUES: dict[str, Any] = {
    "vllm": {"kv_connector": "NixlConnector"},
    "sglang": "nixl",
    "trtllm": {"backend": "DEFAULT"},
}


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _sends_load_reports(engine: type) -> bool:
    """Whether the engine's package (its module, for a one-module engine) builds LoadMetrics."""
    module = importlib.import_module(engine.__module__)
    here = Path(module.__file__ or "")
    files = [here] if module.__package__ == "dynamo_graph.engines" else list(here.parent.glob("*.py"))
    return any("LoadMetrics(" in f.read_text() for f in files)


@pytest.mark.parametrize("name", sorted(registry.ENGINES))
def test_a_record_says_what_its_engine_class_says(name: str) -> None:
    spec = registry.ENGINES[name]
    engine = _load(spec.target)
    assert issubclass(engine, LLMEngine)
    assert engine.publishes_kv_events is spec.kv_events
    assert _sends_load_reports(engine) is spec.load_reports
    assert engine.kv_transfer is spec.kv_transfer  # a class that hands its own KV over, always
    assert (engine.load_lora is not LLMEngine.load_lora) is spec.lora
    if spec.embedding_target is not None:
        assert issubclass(_load(spec.embedding_target), LLMEngine)
    assert set(spec.capabilities) <= {registry.LOGPROBS, *registry.GUIDED}


def test_the_capabilities_of_engines_that_declare_them_as_constants() -> None:
    from dynamo_graph.engines.llamacpp.guided import CAPABILITIES as LLAMACPP
    from dynamo_graph.engines.mistralrs.engine import CAPABILITIES as MISTRALRS

    assert registry.ENGINES["llamacpp"].capabilities == tuple(LLAMACPP)
    assert registry.ENGINES["mistralrs"].capabilities == tuple(MISTRALRS)


@pytest.mark.parametrize("name", sorted(registry.KV_CONNECTOR_ENGINES))
def test_the_connector_argument_makes_a_prefill_worker(name: str, tmp_path: Path) -> None:
    setting, _example = registry.KV_CONNECTOR_ENGINES[name]
    model = tiny_local_model(tmp_path)
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({setting: CONNECTOR_VALUES[name]}))
    engine = create_engine(
        name, EngineSettings(disaggregation_mode="prefill", extra_engine_args=extra), model
    )
    assert engine.kv_transfer
    extra.write_text("{}")
    try:
        bare = create_engine(
            name, EngineSettings(disaggregation_mode="prefill", extra_engine_args=extra), model
        )
    except RunConfigError as err:
        assert setting in str(err)
    else:
        assert not bare.kv_transfer
