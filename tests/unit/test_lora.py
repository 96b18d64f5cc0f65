"""LoRA adapters, the parts without processes: adapter card keys, adapter cards, the worker's
--lora-modules, the graph's `lora_adapters`, the tiny adapter's files, and the mocker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from dynamo_graph.backend.lora import lora_id, parse_lora_modules
from dynamo_graph.backend.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.dev.tiny_lora import GGUF_LORA_NAME, RANK, build_tiny_lora
from dynamo_graph.engines.mocker.args import MockerArgs
from dynamo_graph.engines.mocker.engine import MockerEngine
from dynamo_graph.graph.build import build
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.names import (
    EndpointName,
    adapter_slug_from_key,
    endpoint_from_key,
    instance_id_from_key,
)
from tests.support.graph_problems import problems


def test_adapter_card_keys_parse_like_card_keys() -> None:
    name = EndpointName("ns", "comp", "generate")
    base, adapter = name.card_key(0xABC), name.card_key(0xABC, "sql_lora")
    assert adapter == f"{base}/sql_lora"
    for key in (base, adapter):
        assert endpoint_from_key(key) == name and instance_id_from_key(key) == 0xABC
    assert adapter_slug_from_key(adapter) == "sql_lora" and adapter_slug_from_key(base) is None
    assert instance_id_from_key(name.instance_key(0xDEF)) == 0xDEF
    with pytest.raises(ValueError):
        endpoint_from_key("v1/instances/ns/comp/generate/abc/extra")


def test_an_adapter_card_is_the_base_card_under_its_own_name() -> None:
    base = ModelDeploymentCard.without_files("base", model_input="tokens")
    card = base.for_adapter("My/SQL adapter", "/adapters/sql")
    assert (card.display_name, card.slug) == ("My/SQL adapter", "my_sql_adapter")
    assert card.lora is not None and (card.lora.base_model, card.lora.path) == ("base", "/adapters/sql")
    assert base.lora is None and card.mdcsum() != base.mdcsum()
    # Workers agree on an adapter whatever path each loaded it from.
    assert card.mdcsum() == base.for_adapter("My/SQL adapter", "/elsewhere").mdcsum()
    assert ModelDeploymentCard.from_json(card.to_json()) == card


def test_lora_modules_flag() -> None:
    assert parse_lora_modules(None) == []
    assert parse_lora_modules("a=/x, b=/y/z") == [("a", "/x"), ("b", "/y/z")]
    for bad in ("a", "=/x", "a=", "a=/x,a=/y"):
        with pytest.raises(RunConfigError, match="--lora-modules"):
            parse_lora_modules(bad)
    assert 0 < lora_id("sql") < 2**31 and lora_id("sql") != lora_id("sql2")


GRAPH = """
name: demo
models:
  tiny:
    path: ./model
    lora_adapters: {sql: ./adapters/sql, chat: /abs/chat}
components:
  frontend: {kind: frontend}
  backend: {kind: worker, model: tiny, engine: mocker}
"""


def test_graph_lora_adapters_become_lora_modules(tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH)
    worker = next(p for p in build(path).plan.processes if p.name == "backend-0")
    value = worker.argv[worker.argv.index("--lora-modules") + 1]
    assert value == f"sql={(tmp_path / 'adapters/sql').resolve()},chat=/abs/chat"


@pytest.mark.parametrize("adapters", ["{'a b': /x}", "{'a,b': /x}", "{a: 'x,y'}"])
def test_bad_adapter_names_and_paths_are_graph_problems(adapters: str) -> None:
    graph = GRAPH.replace("{sql: ./adapters/sql, chat: /abs/chat}", adapters)
    (problem,) = problems(graph)
    assert problem.path.startswith("models.tiny.lora_adapters")


def test_tiny_adapter_files(tmp_path: Path) -> None:
    out = build_tiny_lora(tmp_path, "base-model")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK
    tensors = load_file(str(out / "adapter_model.safetensors"))
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert b.shape == (256, RANK) and abs(b).sum() > 0  # not PEFT's zero init: it changes output
    import gguf

    reader = gguf.GGUFReader(out / GGUF_LORA_NAME)
    assert bytes(reader.fields["adapter.type"].parts[-1]).decode() == "lora"
    assert "blk.1.attn_q.weight.lora_b" in {t.name for t in reader.tensors}
    assert (build_tiny_lora(tmp_path / "again", "base-model") / GGUF_LORA_NAME).read_bytes() == (
        out / GGUF_LORA_NAME
    ).read_bytes()  # deterministic


async def test_mocker_adapters_draw_other_tokens_deterministically() -> None:
    from dynamo_graph.backend.lora import LoraAdapter

    engine = MockerEngine(MockerArgs(speedup_ratio=1e6), vocab_size=512)
    await engine.start()

    async def run(model: str) -> list[int]:
        req = PreprocessedRequest(
            model=model,
            token_ids=list(range(1, 40)),
            stop_conditions=StopConditions(max_tokens=8),
            sampling_options=SamplingOptions(temperature=0.0),
        )
        return [t async for out in engine.generate(req, Context()) for t in out.token_ids]

    try:
        base = await run("base")
        await engine.load_lora(LoraAdapter("a", "/a", lora_id("a")))
        await engine.load_lora(LoraAdapter("b", "/b", lora_id("b")))
        a, b = await run("a"), await run("b")
        assert len({tuple(base), tuple(a), tuple(b)}) == 3 and await run("a") == a
        await engine.unload_lora("a")
        assert await run("a") == base
    finally:
        await engine.cleanup()


async def test_mocker_adapter_blocks_are_their_own_and_named_in_kv_events() -> None:
    """As vLLM keys blocks by adapter: an adapter's prompt never hits the base model's cache. Its
    stored events name the adapter and carry the adapter-seeded hashes the kv router computes, so
    an indexer of the adapter holds them and the base model's indexer does not (nor the reverse)."""
    from dynamo_graph.backend.lora import LoraAdapter
    from dynamo_graph.router.kv.hashing import local_block_hashes, lora_hash_seed, sequence_hashes
    from dynamo_graph.router.kv.indexer import KvIndexer
    from dynamo_graph.router.kv.protocols import KvCacheEvent, KvCleared, KvRemoved, KvStored

    indexers = {None: KvIndexer(), "a": KvIndexer(lora_name="a")}

    class Sink:
        """Every event to both indexers, as the frontend's routers of one channel receive them."""

        def __init__(self) -> None:
            self.names: list[str | None] = []
            self.event_id = 0

        def _apply(self, data: KvStored | KvRemoved | KvCleared) -> None:
            self.event_id += 1
            for indexer in indexers.values():
                indexer.apply_event(KvCacheEvent(self.event_id, 7, data))

        def stored(self, parent_hash, blocks, dp_rank=0, lora_name=None) -> None:  # type: ignore[no-untyped-def]
            self.names.append(lora_name)
            self._apply(KvStored(list(blocks), parent_hash, lora_name))

        def removed(self, block_hashes, dp_rank=0) -> None:  # type: ignore[no-untyped-def]
            self._apply(KvRemoved(list(block_hashes)))

        def cleared(self, dp_rank=0) -> None:  # type: ignore[no-untyped-def]
            self._apply(KvCleared())

        def load(self, metrics) -> None:  # type: ignore[no-untyped-def]
            pass

    engine = MockerEngine(MockerArgs(speedup_ratio=1e6, block_size=16), vocab_size=512)
    sink = engine.kv_event_sink = Sink()
    await engine.start()
    prompt = list(range(1, 70))

    async def run(model: str) -> int | None:
        req = PreprocessedRequest(
            model=model,
            token_ids=prompt,
            stop_conditions=StopConditions(max_tokens=2),
            sampling_options=SamplingOptions(temperature=0.0),
        )
        outs = [out async for out in engine.generate(req, Context())]
        await asyncio.sleep(0.01)
        return outs[0].cached_tokens

    def depth(lora: str | None, hashed_as: str | None) -> int:
        local = local_block_hashes(prompt, 16, lora_hash_seed(hashed_as))
        return indexers[lora].find_matches(local, sequence_hashes(local)).get((7, 0), 0)

    try:
        await engine.load_lora(LoraAdapter("a", "/a", lora_id("a")))
        assert await run("a") == 0
        assert set(sink.names) == {"a"}
        assert await run("base") == 0  # the adapter's blocks are not the base model's
        assert sink.names[-1] is None
        assert await run("a") == 64 and await run("base") == 64  # each its own blocks again
        assert depth("a", "a") == 4 and depth(None, None) == 4
        assert depth("a", None) == 0 and depth(None, "a") == 0  # neither index matches the other's
        assert indexers["a"].stats.other_model > 0 and indexers[None].stats.other_model > 0
    finally:
        await engine.cleanup()
    assert depth("a", "a") == 0 and depth(None, None) == 0  # cleared: every index forgets the worker
