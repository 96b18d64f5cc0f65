"""out=trtllm with `tensorrt_llm.LLM` replaced at its API boundary (tensorrt-llm cannot be installed here).

The fake implements what the adapter uses of the real LLM API, in its shapes:
`generate_async(inputs=token_ids, sampling_params=..., streaming=True)` returning a result that is
its own async iterator, with `outputs[0]` a CompletionOutput-like object whose `token_ids` are
cumulative (several tokens per response when the engine batches, the stop token trimmed), a
`finish_reason`, `finished`, `cached_tokens`, and `abort()` (with `disaggregated_params=`: a
context-only request returns DisaggregatedParams on its output, a generation-only one starts its
output with their first_gen_tokens); `get_kv_cache_events_async(timeout)`
yielding event dicts in TensorRT-LLM's serialized layout; `shutdown()`. `_make_sampling_params`
returns the keyword arguments `SamplingParams(...)` would receive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_graph.backend.conformance import conformance_tests
from dynamo_graph.backend.engine import KvImportError
from dynamo_graph.backend.errors import EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import (
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines import create_engine
from dynamo_graph.engines.trtllm.args import (
    TrtllmError,
    import_tensorrt_llm,
    llm_args_from_settings,
    sampling_kwargs,
    visible_devices,
)
from dynamo_graph.engines.trtllm.engine import DEFAULT_EVENT_BUFFER, TrtllmEngine
from dynamo_graph.engines.trtllm.kv_events import TrtllmKvEventBridge
from dynamo_graph.llm.model_source import LocalModel
from dynamo_graph.router.kv.hashing import local_block_hashes
from dynamo_graph.router.kv.protocols import StoredBlock
from dynamo_graph.runtime.context import Context
from tests.support.engine_adapters import EOS, RecordingSink, collect, request, tiny_local_model, tokens

NAMES = {
    "model",
    "backend",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "kv_cache_config",
    "max_seq_len",
    "max_batch_size",
    "max_num_tokens",
    "guided_decoding_backend",
    "cache_transceiver_config",
}


@pytest.fixture
def model(tmp_path: Path) -> LocalModel:
    return tiny_local_model(tmp_path)


# ---- the fake tensorrt_llm.LLM ------------------------------------------------------------------


@dataclasses.dataclass
class FakeDisaggregatedParams:
    """tensorrt_llm.llmapi.DisaggregatedParams' fields (a dataclass there too)."""

    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None


class FakeCompletionOutput:
    def __init__(self) -> None:
        self.index = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.disaggregated_params: FakeDisaggregatedParams | None = None


class FakeResult:
    """A GenerationResult: iterating it yields itself after each engine response."""

    def __init__(
        self, llm: FakeLLM, prompt: list[int], params: dict[str, Any], disagg: FakeDisaggregatedParams | None
    ) -> None:
        self.llm = llm
        self.prompt = prompt
        self.params = params
        self.disaggregated = disagg
        self.outputs = [FakeCompletionOutput()]
        if disagg is not None and disagg.request_type == "generation_only":
            self.outputs[0].token_ids = list(disagg.first_gen_tokens or ())
        self.finished = False
        self.cached_tokens = llm.cached
        self.aborts = 0
        self._aborted = False

    def abort(self) -> None:
        self.aborts += 1
        self._aborted = True

    def __aiter__(self) -> FakeResult:
        return self

    async def __anext__(self) -> FakeResult:
        if self.finished:
            raise StopAsyncIteration
        await asyncio.sleep(self.llm.delay)
        out = self.outputs[0]
        if self._aborted:
            out.finish_reason, self.finished = "cancelled", True
            return self
        if self.llm.finish_with is not None:
            out.finish_reason, self.finished = self.llm.finish_with, True
            return self
        limit = self.params.get("max_tokens", 32)
        stops = set(self.params.get("stop_token_ids") or ())
        for _ in range(self.llm.per_step):
            token = 100 + len(out.token_ids)
            out.token_ids.append(token)
            if token in stops:  # TensorRT-LLM trims a matched stop word from token_ids
                out.token_ids.pop()
                out.finish_reason, out.stop_reason, self.finished = "stop", token, True
                break
            if len(out.token_ids) >= limit:
                out.finish_reason, self.finished = "length", True
                break
        if (
            self.finished
            and self.disaggregated is not None
            and self.disaggregated.request_type == "context_only"
        ):
            out.disaggregated_params = FakeDisaggregatedParams(
                request_type="context_only",
                first_gen_tokens=out.token_ids[:1],
                ctx_request_id=77,
                opaque_state=b"\x00transceiver state\xff",
            )
        return self


class FakeLLM:
    def __init__(self, llm_args: dict[str, Any], *, delay: float = 0.0, cached: int | None = None) -> None:
        self.llm_args = llm_args
        self.delay = delay
        self.cached = cached
        self.per_step = 1
        self.finish_with: str | None = None
        self.results: list[FakeResult] = []
        self.kv_events: list[dict[str, Any]] = []
        self.kv_polls = 0
        self.shutdowns = 0

    def generate_async(
        self,
        inputs: list[int],
        sampling_params: Any = None,
        streaming: bool = False,
        disaggregated_params: FakeDisaggregatedParams | None = None,
    ) -> FakeResult:
        # Streamed, except context-only requests (Dynamo's worker does not stream those).
        context_only = (
            disaggregated_params is not None and disaggregated_params.request_type == "context_only"
        )
        assert streaming is not context_only
        result = FakeResult(self, list(inputs), sampling_params, disaggregated_params)
        self.results.append(result)
        return result

    async def get_kv_cache_events_async(self, timeout: float | None = 2):  # noqa: ASYNC109 - the real signature
        self.kv_polls += 1
        while self.kv_events:
            yield self.kv_events.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


class FakeTrtllmEngine(TrtllmEngine):
    names: set[str] | None = NAMES
    fake_options: dict[str, Any] = {}  # noqa: RUF012 - set per test

    def _llm_arg_names(self) -> set[str] | None:
        return self.names

    def _create_backend(self, llm_args: dict[str, Any]) -> FakeLLM:
        self.fake = FakeLLM(llm_args, **self.fake_options)
        return self.fake

    def _make_sampling_params(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return dict(kwargs)

    def _make_disaggregated_params(self, kwargs: dict[str, Any]) -> FakeDisaggregatedParams:
        return FakeDisaggregatedParams(**kwargs)


def make_engine(**llm_args: Any) -> FakeTrtllmEngine:
    return FakeTrtllmEngine(
        {"model": "/m", "backend": "pytorch", "tensor_parallel_size": 1, **llm_args},
        default_context_length=4096,
    )


# ---- settings -----------------------------------------------------------------------------------


def test_flags_and_yaml_map_to_llm_kwargs(model: LocalModel, tmp_path: Path) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text(
        "max_batch_size: 8\nkv_cache_config:\n  free_gpu_memory_fraction: 0.5\n  enable_block_reuse: true\n"
        "guided_decoding_backend: xgrammar\n"
    )
    cfg = EngineSettings(
        tensor_parallel_size=2, kv_cache_block_size=64, context_length=2048, extra_engine_args=extra
    )
    assert llm_args_from_settings(cfg, model) == {
        "model": str(model.root),
        "backend": "pytorch",
        "tensor_parallel_size": 2,
        "max_seq_len": 2048,
        "kv_cache_config": {
            "tokens_per_block": 64,
            "free_gpu_memory_fraction": 0.5,
            "enable_block_reuse": True,
        },
        "max_batch_size": 8,
        "guided_decoding_backend": "xgrammar",
    }
    assert llm_args_from_settings(EngineSettings(), model) == {
        "model": str(model.root),
        "backend": "pytorch",
        "tensor_parallel_size": 1,
        "kv_cache_config": {"tokens_per_block": 32},
    }
    as_json = tmp_path / "extra.json"  # JSON is YAML too
    as_json.write_text(json.dumps({"kv_cache_config": {"tokens_per_block": 16}}))
    args = llm_args_from_settings(EngineSettings(extra_engine_args=as_json), model)
    assert args["kv_cache_config"] == {"tokens_per_block": 16}


def test_bad_settings_are_refused(model: LocalModel, tmp_path: Path) -> None:
    conflict = tmp_path / "c.yaml"
    conflict.write_text("kv_cache_config:\n  tokens_per_block: 16\n")
    with pytest.raises(
        TrtllmError, match=r"--kv-cache-block-size 64 conflicts with kv_cache_config.tokens_per_block"
    ):
        llm_args_from_settings(EngineSettings(kv_cache_block_size=64, extra_engine_args=conflict), model)
    listing = tmp_path / "l.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(RunConfigError, match="must hold a mapping"):
        llm_args_from_settings(EngineSettings(extra_engine_args=listing), model)
    broken = tmp_path / "b.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(RunConfigError, match="not valid YAML"):
        llm_args_from_settings(EngineSettings(extra_engine_args=broken), model)
    with pytest.raises(TrtllmError, match=r"MPI job.*trtllm-llmapi-launch"):
        llm_args_from_settings(EngineSettings(num_nodes=2, leader_addr="10.0.0.1:5000"), model)
    gguf = LocalModel(
        source="m.gguf", kind="gguf", root=tmp_path, display_name="m", gguf_path=tmp_path / "m.gguf"
    )
    with pytest.raises(TrtllmError, match="GGUF"):
        llm_args_from_settings(EngineSettings(), gguf)


def test_base_gpu_id_selects_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert visible_devices(0, 2, None) is None
    assert visible_devices(2, 2, None) == "2,3"
    assert visible_devices(1, 2, "4,5,6") == "5,6"
    with pytest.raises(TrtllmError, match="needs more devices"):
        visible_devices(2, 2, "0,1,2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored (unset) after the test
    engine = FakeTrtllmEngine(
        {"model": "/m", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}, base_gpu_id=4
    )
    asyncio.run(engine.start())
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" == engine.cuda_visible_devices
    asyncio.run(engine.cleanup())


async def test_unknown_llm_arguments_are_refused_with_the_valid_ones() -> None:
    engine = make_engine(max_batch=8)
    with pytest.raises(TrtllmError) as err:
        await engine.start()
    assert "'max_batch'" in str(err.value) and "did you mean max_batch_size" in str(err.value)
    assert "valid arguments: " in str(err.value) and isinstance(err.value, RunConfigError)
    engine = make_engine(anything=1)
    engine.names = None  # the installed TensorRT-LLM cannot list them: it validates itself
    await engine.start()
    assert engine.fake.llm_args["anything"] == 1
    await engine.cleanup()


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, model: LocalModel) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(TrtllmError, match=r"pip install -e '\.\[trtllm\]' in dyngraph's checkout.*CUDA"):
        import_tensorrt_llm()
    engine = create_engine("trtllm", EngineSettings(), model)
    assert isinstance(engine, TrtllmEngine)
    with pytest.raises(RunConfigError, match=r"pip install -e '\.\[trtllm\]'"):
        asyncio.run(engine.start())


def test_sampling_mapping() -> None:
    req = PreprocessedRequest(
        model="tiny",
        token_ids=[0, 1, 2],
        stop_conditions=StopConditions(
            max_tokens=7, min_tokens=2, stop_token_ids=[9], stop_token_ids_hidden=[5]
        ),
        sampling_options=SamplingOptions(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            frequency_penalty=0.1,
            presence_penalty=0.2,
            repetition_penalty=1.1,
            seed=42,
            guided_json={"type": "object"},
        ),
        eos_token_ids=list(EOS),
    )
    assert sampling_kwargs(req) == {
        "detokenize": False,
        "max_tokens": 7,
        "min_tokens": 2,
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.1,
        "seed": 42,
        "end_id": 4,
        "stop_token_ids": [9, 1, 5],
        "guided_decoding": {"json": {"type": "object"}},
    }
    greedy = PreprocessedRequest(
        model="t",
        token_ids=[1, 2],
        stop_conditions=StopConditions(ignore_eos=True),
        sampling_options=SamplingOptions(temperature=0.0, top_p=0.5, top_k=0, guided_choice=["x", "y"]),
        eos_token_ids=list(EOS),
    )
    assert sampling_kwargs(greedy, context_length=10) == {
        "detokenize": False,
        "max_tokens": 8,
        "top_k": 1,
        "end_id": 4,
        "ignore_eos": True,
        "guided_decoding": {"regex": "(x|y)"},
    }
    with pytest.raises(InvalidArgument, match="logit_bias"):
        sampling_kwargs(
            PreprocessedRequest(
                model="t", token_ids=[1], sampling_options=SamplingOptions(logit_bias={"1": 1})
            )
        )
    with pytest.raises(InvalidArgument, match="n > 1"):
        sampling_kwargs(
            PreprocessedRequest(model="t", token_ids=[1], sampling_options=SamplingOptions(best_of=2))
        )


# ---- streaming ----------------------------------------------------------------------------------


@pytest.mark.parametrize("per_step", [1, 3])
async def test_streams_deltas_of_cumulative_token_ids(per_step: int) -> None:
    engine = make_engine()
    engine.fake_options = {"cached": 3}
    config = await engine.start()
    assert config.kv_cache_block_size == 32 and config.context_length == 4096
    engine.fake.per_step = per_step
    outs = await collect(engine, request(7))
    assert tokens(outs) == [100, 101, 102, 103, 104, 105, 106]
    assert outs[0].cached_tokens == 3 and all(o.cached_tokens is None for o in outs[1:])
    assert [o.finish_reason for o in outs][-1] == "length" and all(o.finish_reason is None for o in outs[:-1])
    usage = outs[-1].completion_usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (4, 7)
    result = engine.fake.results[0]
    assert result.prompt == [0, 10, 11, 12]
    assert result.params == {"detokenize": False, "max_tokens": 7, "end_id": 4, "stop_token_ids": [1]}
    await engine.cleanup()


async def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    engine = make_engine(max_seq_len=10)
    await engine.start()
    outs = await collect(engine, request(None))
    assert len(tokens(outs)) == 6 and outs[-1].finish_reason == "length"
    await engine.cleanup()


async def test_stop_token_trimmed_by_the_engine_ends_with_stop() -> None:
    engine = make_engine()
    await engine.start()
    outs = await collect(engine, request(10, stop_token_ids=[102]))
    assert tokens(outs) == [100, 101] and outs[-1].finish_reason == "stop"
    await engine.cleanup()


async def test_timeout_is_an_error_finish() -> None:
    engine = make_engine()
    await engine.start()
    engine.fake.finish_with = "timeout"
    outs = await collect(engine, request(3))
    assert outs[-1].finish_reason == "error" and "timed" in (outs[-1].error or "")
    await engine.cleanup()


# ---- cancellation and lifecycle -----------------------------------------------------------------


async def test_cancellation_aborts_the_result() -> None:
    engine = make_engine()
    engine.fake_options = {"delay": 0.01}
    await engine.start()
    ctx = Context()
    outs = []
    async for out in engine.generate(request(1000), ctx):
        outs.append(out)
        if len(outs) == 2:
            ctx.stop_generating()
    assert outs[-1].finish_reason == "cancelled" and len(tokens(outs)) < 1000
    assert engine.fake.results[0].aborts == 1
    await engine.drain()
    await engine.cleanup()


async def test_a_consumer_that_leaves_aborts_and_abort_hook_aborts() -> None:
    engine = make_engine()
    engine.fake_options = {"delay": 0.01}
    await engine.start()
    gen = engine.generate(request(1000), Context())
    await gen.__anext__()
    await gen.aclose()
    assert engine.fake.results[0].aborts == 1
    ctx = Context()
    gen2 = engine.generate(request(1000), ctx)
    await gen2.__anext__()
    await engine.abort(ctx)
    rest = [o async for o in gen2]
    assert rest[-1].finish_reason == "cancelled" and engine.fake.results[1].aborts == 1
    await engine.cleanup()


async def test_cleanup_is_idempotent_and_safe_before_start() -> None:
    await make_engine().cleanup()
    engine = make_engine()
    await engine.start()
    fake = engine.fake
    await engine.cleanup()
    await engine.cleanup()
    assert fake.shutdowns == 1
    with pytest.raises(EngineShutdown):
        await collect(engine, request(1))


# ---- KV events ----------------------------------------------------------------------------------


def _block(block_hash: int, toks: list[int]) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks],
        "lora_id": None,
        "cache_level": 0,
        "priority": 35,
    }


# ---- disaggregated prefill/decode -----------------------------------------------------------


def test_disaggregation_needs_a_cache_transceiver(model: LocalModel, tmp_path: Path) -> None:
    for mode in ("prefill", "decode"):
        with pytest.raises(
            TrtllmError, match=f"--disaggregation-mode {mode}: .* add cache_transceiver_config"
        ):
            llm_args_from_settings(EngineSettings(disaggregation_mode=mode), model)
    extra = tmp_path / "decode.yaml"
    extra.write_text("cache_transceiver_config:\n  backend: UCX\ndisable_overlap_scheduler: true\n")
    args = llm_args_from_settings(
        EngineSettings(disaggregation_mode="decode", extra_engine_args=extra), model
    )
    engine = TrtllmEngine(args)
    assert engine.kv_transfer and engine.kv_format == "trtllm-connector/1:UCX"
    assert not TrtllmEngine(llm_args_from_settings(EngineSettings(), model)).kv_transfer
    assert make_engine(cache_transceiver_config={}).kv_transfer is False


async def test_context_only_then_generation_only_on_another_engine() -> None:
    prefiller = make_engine(cache_transceiver_config={"backend": "DEFAULT"})
    decoder = make_engine(cache_transceiver_config={"backend": "DEFAULT"})
    await prefiller.start()
    await decoder.start()
    first, handoff = await prefiller.prefill(request(5, min_tokens=2), Context())
    assert first.token_ids == [100] and first.finish_reason is None
    context_only = prefiller.fake.results[0]
    assert context_only.disaggregated == FakeDisaggregatedParams(request_type="context_only")
    assert (context_only.params["max_tokens"], context_only.params["min_tokens"]) == (1, 1)
    assert handoff is not None and handoff.format == "trtllm-connector/1:DEFAULT" and handoff.num_tokens == 4

    # The decode request is the frontend's continuation: the prompt and the first token, one less to go.
    follow = msgspec.structs.replace(request(4, min_tokens=1), token_ids=[0, 10, 11, 12, 100])
    outs = [out async for out in decoder.generate_from_kv(follow, handoff, Context())]
    assert tokens(outs) == [101, 102, 103, 104] and outs[-1].finish_reason == "length"
    usage = outs[-1].completion_usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (5, 4)
    generation_only = decoder.fake.results[0]
    assert generation_only.prompt == [0, 10, 11, 12]  # TensorRT-LLM's output starts at the first token
    assert (generation_only.params["max_tokens"], generation_only.params["min_tokens"]) == (5, 2)
    assert generation_only.disaggregated == FakeDisaggregatedParams(
        request_type="generation_only",
        first_gen_tokens=[100],
        ctx_request_id=77,
        opaque_state=b"\x00transceiver state\xff",
    )

    # A continuation that does not follow the prefill's first token is refused before anything runs.
    other = msgspec.structs.replace(follow, token_ids=[0, 10, 11, 12, 999])
    with pytest.raises(KvImportError, match="not the prefill's first tokens"):
        await anext(decoder.generate_from_kv(other, handoff, Context()))
    assert len(decoder.fake.results) == 1
    # A request that ends at its first token hands nothing over.
    done, nothing = await prefiller.prefill(request(1), Context())
    assert nothing is None and done.finish_reason == "length"
    await prefiller.cleanup()
    await decoder.cleanup()


def test_kv_bridge_converts_trtllm_events() -> None:
    sink = RecordingSink()
    bridge = TrtllmKvEventBridge(sink, block_size=4)
    toks = list(range(10))
    bridge.handle({"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}})
    bridge.handle(
        {
            "event_id": 1,
            "attention_dp_rank": 1,
            "data": {
                "type": "stored",
                "parent_hash": -3,
                "blocks": [_block(21, toks[0:4]), _block(22, toks[4:8]), _block(23, toks[8:])],
            },
        }
    )
    bridge.handle({"event_id": 2, "data": {"type": "updated", "block_hash": 21, "cache_level": {}}})
    bridge.handle(
        {"event_id": 3, "attention_dp_rank": 1, "data": {"type": "removed", "block_hashes": [23, 21]}}
    )
    local = local_block_hashes(toks, 4)
    assert sink.events == [
        ("stored", (-3) & ((1 << 64) - 1), [StoredBlock(21, local[0]), StoredBlock(22, local[1])], 1),
        ("removed", [21], 1),  # 23 was partial: the router never saw it
    ]


async def test_kv_events_are_polled_from_the_llm() -> None:
    sink = RecordingSink()
    engine = make_engine(kv_cache_config={"tokens_per_block": 4})
    engine.kv_event_sink = sink
    await engine.start()
    assert engine.launched_args["kv_cache_config"] == {
        "tokens_per_block": 4,
        "event_buffer_max_size": DEFAULT_EVENT_BUFFER,
    }
    toks = [7, 8, 9, 10]
    engine.fake.kv_events.append(
        {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [_block(5, toks)]}}
    )
    for _ in range(500):
        if sink.events:
            break
        await asyncio.sleep(0.01)
    assert sink.events == [("stored", None, [StoredBlock(5, local_block_hashes(toks, 4)[0])], 0)]
    await engine.cleanup()
    assert sink.events[-1] == ("cleared", 0)


async def test_no_kv_events_without_block_reuse() -> None:
    sink = RecordingSink()
    engine = make_engine(kv_cache_config={"enable_block_reuse": False})
    engine.kv_event_sink = sink
    await engine.start()
    assert "event_buffer_max_size" not in engine.launched_args["kv_cache_config"]
    assert engine._kv_task is None
    await engine.cleanup()
    assert sink.events == []


# ---- the engine conformance kit -----------------------------------------------------------------


def _conformance_engine() -> FakeTrtllmEngine:
    engine = make_engine()
    engine.fake_options = {"delay": 0.001}
    return engine


test_conformance = conformance_tests(_conformance_engine, request, concurrency=4)
