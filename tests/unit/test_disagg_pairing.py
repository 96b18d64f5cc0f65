"""A change that prefill and decode workers cannot roll through: what they must share for KV to
move between them is one signature per worker (compile.py), and a revision that changes it
while both pools serve is refused before anything starts (changes.unpaired)."""

from __future__ import annotations

from pathlib import Path

from dynamo_graph.graph.build import build
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local.changes import unpaired

EXAMPLE = Path(__file__).resolve().parents[2] / "graphs" / "examples" / "disagg-mocker.yaml"


def _plan(*overrides: str) -> Plan:
    return build(EXAMPLE, list(overrides)).plan


def _pairings(plan: Plan) -> dict[str, str]:
    return {p.name: p.pairing for p in plan.processes if p.role in ("prefill", "decode")}


def test_a_models_prefill_and_decode_workers_share_one_signature_that_the_kv_shape_changes() -> None:
    base = _pairings(_plan())
    assert len(set(base.values())) == 1 and next(iter(base.values())).startswith("tiny-model@")
    unrelated = _plan("+components.decode.engine_args={speedup_ratio: 2.0}")
    assert set(_pairings(unrelated).values()) == set(base.values())
    blocks = _plan("models.llm.kv_cache_block_size=32")
    assert set(_pairings(blocks).values()).isdisjoint(base.values())
    decode_only = _pairings(_plan("+components.decode.engine_args={block_size: 32}"))
    assert decode_only["decode-0"] != decode_only["prefill-0"]


def test_a_revision_that_changes_the_kv_shape_of_both_pools_is_refused_with_the_steps() -> None:
    running = _plan()
    why = unpaired(running, _plan("models.llm.kv_cache_block_size=32"))
    assert why is not None and "model tiny-model" in why and "replicas: 0" in why
    assert unpaired(running, _plan("+components.decode.engine_args={block_size: 32}")) is not None


def test_changes_that_pair_nothing_across_revisions_are_not_refused() -> None:
    running = _plan()
    assert unpaired(None, running) is None  # a first start
    assert unpaired(running, _plan("+components.decode.engine_args={speedup_ratio: 2.0}")) is None
    no_prefill = _plan("components.prefill.replicas=0")
    assert (
        unpaired(running, _plan("components.prefill.replicas=0", "models.llm.kv_cache_block_size=32")) is None
    )
    assert unpaired(no_prefill, _plan("models.llm.kv_cache_block_size=32")) is None
