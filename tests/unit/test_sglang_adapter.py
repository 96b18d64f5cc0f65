"""out=sglang with `sglang.Engine` replaced at its API boundary (sglang cannot be installed here).

The fake implements what the adapter uses of the real Engine, in the shapes SGLang returns:
`async_generate(input_ids=..., sampling_params=..., stream=True, rid=...)` giving an async iterator
of `{"output_ids", "meta_info"}` dicts (cumulative ids sharing one growing list, or incremental
ids, as SGLang's `incremental_streaming_output` / `stream_output` setting decides),
`tokenizer_manager.abort_request(rid=..., abort_all=False)`, `get_server_info()` and `shutdown()`;
its KV events over a real ZMQ socket: tests/integration/test_sglang_kv_events.py. In PD mode
(`disaggregation_mode`), a prefill request waits for a decode request to join its `bootstrap_room`
before it computes its one token, as SGLang's prefill waits for the decode engine's allocation,
and the decode request streams only once that prefill has sent the KV (a prefill that fails
leaves it waiting, as SGLang's decode waits for a transfer that does not come).

Disaggregated serving runs the frontend's real DisaggRouter over these engines behind the real
worker handler (`tokens_handler`), the requests crossing as msgpack, as on the request plane.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_graph.backend.conformance import conformance_tests
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.handlers import tokens_handler
from dynamo_graph.backend.protocol import (
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.backend.worker import runtime_config
from dynamo_graph.engines import create_engine
from dynamo_graph.engines.sglang.args import (
    DEFAULT_PAGE_SIZE,
    SglangError,
    import_sglang,
    sampling_params,
    server_args_from_settings,
)
from dynamo_graph.engines.sglang.engine import SglangEngine
from dynamo_graph.engines.sglang.kv_events import SglangKvEventBridge
from dynamo_graph.llm.model_source import LocalModel
from dynamo_graph.router.config import DisaggConfig
from dynamo_graph.router.disagg import DisaggRouter, NoPrefillWorkers, bootstrap_address
from dynamo_graph.router.kv.hashing import local_block_hashes
from dynamo_graph.router.kv.protocols import StoredBlock
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import RequestError
from dynamo_graph.runtime.transport.base import CannotConnect
from tests.support.engine_adapters import EOS, RecordingSink, collect, request, tiny_local_model, tokens

FIELDS = {
    "model_path",
    "skip_tokenizer_init",
    "tp_size",
    "base_gpu_id",
    "page_size",
    "context_length",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "kv_events_config",
    "mem_fraction_static",
    "dp_size",
    "enable_dp_attention",
    "disable_radix_cache",
    "disaggregation_mode",
    "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port",
}
# Bootstrap rooms joined by decode requests, and those whose KV the prefill sent (SGLang pairs a
# prefill and a decode request by room).
ROOMS: dict[int, asyncio.Event] = {}
SENT: dict[int, asyncio.Event] = {}


@pytest.fixture
def model(tmp_path: Path) -> LocalModel:
    return tiny_local_model(tmp_path)


# ---- the fake sglang.Engine ---------------------------------------------------------------------


class FakeTokenizerManager:
    def __init__(self, engine: FakeSglang) -> None:
        self.engine = engine
        self.context_len = 4096
        self.aborted: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)
        self.engine.abort_flags.add(rid)


class FakeSglang:
    """Streams ids 100, 101, ... like SGLang with skip_tokenizer_init (see the module docstring)."""

    def __init__(self, server_args: dict[str, Any], *, delay: float = 0.0, cached: int = 0) -> None:
        self.server_args = server_args
        self.incremental = bool(
            server_args.get("incremental_streaming_output") or server_args.get("stream_output")
        )
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.delay = delay
        self.cached = cached
        self.calls: list[dict[str, Any]] = []
        self.abort_flags: set[str] = set()
        self.shutdowns = 0
        self.per_step = 1  # tokens per streamed chunk
        self.abort_status: int | None = None  # make the engine refuse the request itself
        self.transfer_fails = False  # a prefill whose KV transfer fails once the decode joined

    def get_server_info(self) -> dict[str, Any]:
        return {"max_total_num_tokens": 8192, "max_running_requests": 48}

    async def async_generate(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        self.abort_flags.discard(kwargs["rid"])  # an id is aborted until a request takes it again
        return self._stream(**kwargs)

    async def _stream(self, input_ids, sampling_params, stream, rid, bootstrap_room=None, **_: Any):
        assert stream is True
        stop_ids = set(sampling_params.get("stop_token_ids") or ())
        limit = sampling_params.get("max_new_tokens", 128)
        mode = self.server_args.get("disaggregation_mode")
        if mode == "prefill":  # computes the first token once a decode request joined the room
            await ROOMS.setdefault(bootstrap_room, asyncio.Event()).wait()
            if self.transfer_fails:
                raise RuntimeError(f"KVTransferError(bootstrap_room={bootstrap_room}): connection refused")
            SENT.setdefault(bootstrap_room, asyncio.Event()).set()
            limit = 1
        elif mode == "decode":  # streams once the prefill engine sent the KV
            ROOMS.setdefault(bootstrap_room, asyncio.Event()).set()
            while not SENT.setdefault(bootstrap_room, asyncio.Event()).is_set():
                await asyncio.sleep(0.001)
                if rid in self.abort_flags:
                    yield {"output_ids": [], "meta_info": {"id": rid, "finish_reason": {"type": "abort"}}}
                    return
        output: list[int] = []  # SGLang's state.output_ids: one list, appended to in place
        sent = 0

        def meta(finish: Any) -> dict[str, Any]:
            return {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(output),
                "cached_tokens": self.cached,
            }

        def chunk(finish: Any = None) -> dict[str, Any]:
            nonlocal sent
            if self.incremental:
                ids, sent = output[sent:], len(output)
                return {"output_ids": ids, "meta_info": meta(finish)}
            return {"output_ids": output if finish is None else list(output), "meta_info": meta(finish)}

        if self.abort_status is not None:
            yield chunk({"type": "abort", "message": "input too long", "status_code": self.abort_status})
            return
        while True:
            await asyncio.sleep(self.delay)
            if rid in self.abort_flags:
                yield chunk({"type": "abort", "message": "Abort in waiting queue"})
                return
            finish = None
            for _ in range(self.per_step):
                token = 100 + len(output)
                output.append(token)
                if token in stop_ids:
                    finish = {"type": "stop", "matched": token}
                    break
                if len(output) >= limit:
                    finish = {"type": "length", "length": limit}
                    break
            yield chunk(finish)
            if finish is not None:
                return

    def shutdown(self) -> None:
        self.shutdowns += 1


class FakeSglangEngine(SglangEngine):
    fields: set[str] = FIELDS | {"incremental_streaming_output"}
    fake_options: dict[str, Any] = {}  # noqa: RUF012 - set per test on the subclass

    def _server_args_fields(self) -> set[str]:
        return self.fields

    def _create_backend(self, server_args: dict[str, Any]) -> FakeSglang:
        self.fake = FakeSglang(server_args, **self.fake_options)
        return self.fake


def make_engine(fields: set[str] | None = None, **server_args: Any) -> FakeSglangEngine:
    engine = FakeSglangEngine(
        {"model_path": "/m", "skip_tokenizer_init": True, "page_size": 4, **server_args},
        default_context_length=4096,
    )
    if fields is not None:
        engine.fields = fields
    return engine


# ---- settings -----------------------------------------------------------------------------------


def test_flags_map_to_server_args(model: LocalModel, tmp_path: Path) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"mem_fraction_static": 0.8, "kv_events_config": {"publisher": "zmq"}}))
    cfg = EngineSettings(
        tensor_parallel_size=2,
        base_gpu_id=1,
        kv_cache_block_size=32,
        context_length=1024,
        num_nodes=2,
        node_rank=1,
        leader_addr="10.0.0.1:5000",
        extra_engine_args=extra,
    )
    assert server_args_from_settings(cfg, model) == {
        "model_path": str(model.root),
        "skip_tokenizer_init": True,
        "tp_size": 2,
        "base_gpu_id": 1,
        "page_size": 32,
        "context_length": 1024,
        "nnodes": 2,
        "node_rank": 1,
        "dist_init_addr": "10.0.0.1:5000",
        "mem_fraction_static": 0.8,
        "kv_events_config": '{"publisher": "zmq"}',
    }
    defaults = server_args_from_settings(EngineSettings(), model)
    assert defaults == {
        "model_path": str(model.root),
        "skip_tokenizer_init": True,
        "tp_size": 1,
        "base_gpu_id": 0,
        "page_size": DEFAULT_PAGE_SIZE,
    }


def test_extra_args_override_defaults_but_not_given_flags(model: LocalModel, tmp_path: Path) -> None:
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"tp_size": 4, "page_size": 64}))
    args = server_args_from_settings(EngineSettings(extra_engine_args=extra), model)
    assert (args["tp_size"], args["page_size"]) == (4, 64)
    with pytest.raises(SglangError, match=r"--tensor-parallel-size 2 conflicts with tp_size=4"):
        server_args_from_settings(EngineSettings(tensor_parallel_size=2, extra_engine_args=extra), model)


async def test_unknown_server_args_are_refused_with_the_valid_ones() -> None:
    engine = make_engine(tp=2)
    with pytest.raises(SglangError) as err:
        await engine.start()
    assert "'tp'" in str(err.value) and "did you mean tp_size" in str(err.value)
    assert "valid fields: " in str(err.value) and "mem_fraction_static" in str(err.value)
    assert isinstance(err.value, RunConfigError)
    await engine.cleanup()


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, model: LocalModel) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` raises ImportError
    with pytest.raises(SglangError, match=r"pip install -e '\.\[sglang\]' in dyngraph's checkout.*CUDA"):
        import_sglang()
    engine = create_engine("sglang", EngineSettings(), model)
    assert isinstance(engine, SglangEngine)
    with pytest.raises(RunConfigError, match=r"pip install -e '\.\[sglang\]'"):
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
            top_k=0,
            min_p=0.05,
            frequency_penalty=0.1,
            presence_penalty=0.2,
            repetition_penalty=1.1,
            seed=42,
            logit_bias={"7": -1.0},
            guided_regex="a+",
        ),
        eos_token_ids=list(EOS),
    )
    assert sampling_params(req) == {
        "max_new_tokens": 7,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.1,
        "sampling_seed": 42,
        "logit_bias": {"7": -1.0},
        "stop_token_ids": [1, 4, 5, 9],
        "regex": "a+",
    }
    plain = PreprocessedRequest(
        model="tiny",
        token_ids=[0, 1, 2],
        stop_conditions=StopConditions(ignore_eos=True, stop_token_ids=[9]),
        sampling_options=SamplingOptions(guided_json={"type": "object"}),
        eos_token_ids=list(EOS),
    )
    assert sampling_params(plain, context_length=10) == {
        "max_new_tokens": 7,
        "ignore_eos": True,
        "stop_token_ids": [9],
        "json_schema": '{"type": "object"}',
    }
    choice = PreprocessedRequest(
        model="t", token_ids=[1], sampling_options=SamplingOptions(guided_choice=["a.b", "c"])
    )
    assert sampling_params(choice) == {"regex": r"(a\.b|c)"}
    grammar = PreprocessedRequest(
        model="t", token_ids=[1], sampling_options=SamplingOptions(guided_grammar="g")
    )
    assert sampling_params(grammar) == {"ebnf": "g"}
    with pytest.raises(InvalidArgument):
        sampling_params(PreprocessedRequest(model="t", token_ids=[1], sampling_options=SamplingOptions(n=2)))


# ---- streaming ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "extra", "incremental"),
    [
        (FIELDS | {"incremental_streaming_output"}, {}, True),  # newer SGLang: we turn it on
        (FIELDS | {"stream_output"}, {}, True),  # SGLang <= 0.5.x: the older name
        (FIELDS, {}, False),  # neither setting: cumulative ids
        (FIELDS | {"incremental_streaming_output"}, {"incremental_streaming_output": False}, False),
    ],
)
@pytest.mark.parametrize("per_step", [1, 3])
async def test_streams_deltas_in_both_modes(
    fields: set[str], extra: dict[str, Any], incremental: bool, per_step: int
) -> None:
    engine = make_engine(fields, **extra)
    engine.fake_options = {"cached": 3}
    config = await engine.start()
    engine.fake.per_step = per_step
    assert engine.incremental is incremental and engine.fake.incremental is incremental
    assert config.kv_cache_block_size == 4 and config.total_kv_blocks == 2048 and config.max_num_seqs == 48
    outs = await collect(engine, request(7))
    assert tokens(outs) == [100, 101, 102, 103, 104, 105, 106]
    assert all(out.token_ids for out in outs[:-1])
    assert outs[0].cached_tokens == 3 and all(out.cached_tokens is None for out in outs[1:])
    assert [out.finish_reason for out in outs] == [None] * (len(outs) - 1) + ["length"]
    usage = outs[-1].completion_usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
        4,
        7,
        3,
    )
    call = engine.fake.calls[0]
    assert call["input_ids"] == [0, 10, 11, 12] and call["stream"] is True and call["rid"]
    assert call["sampling_params"] == {"max_new_tokens": 7, "stop_token_ids": [1, 4]}
    await engine.cleanup()


async def test_stop_token_ends_the_stream_with_stop() -> None:
    engine = make_engine()
    await engine.start()
    outs = await collect(engine, request(10, stop_token_ids=[102]))
    assert tokens(outs) == [100, 101, 102] and outs[-1].finish_reason == "stop"
    await engine.cleanup()


async def test_dp_rank_is_passed_on() -> None:
    engine = make_engine()
    await engine.start()
    req = request(1)
    req.dp_rank = 1
    await collect(engine, req)
    assert engine.fake.calls[0]["data_parallel_rank"] == 1
    await engine.cleanup()


@pytest.mark.parametrize(("status", "error"), [(400, InvalidArgument), (500, Exception)])
async def test_an_abort_we_did_not_ask_for_is_an_error(status: int, error: type[Exception]) -> None:
    engine = make_engine()
    await engine.start()
    engine.fake.abort_status = status
    with pytest.raises(error, match="input too long"):
        await collect(engine, request(3))
    await engine.cleanup()


# ---- cancellation and lifecycle -----------------------------------------------------------------


async def test_cancellation_aborts_the_request_by_rid() -> None:
    engine = make_engine()
    engine.fake_options = {"delay": 0.01}
    await engine.start()
    ctx = Context("req-1")
    outs = []
    async for out in engine.generate(request(1000), ctx):
        outs.append(out)
        if len(outs) == 2:
            ctx.stop_generating()
    assert outs[-1].finish_reason == "cancelled" and len(tokens(outs)) < 1000
    assert engine.fake.tokenizer_manager.aborted == ["req-1"]
    assert not engine._active
    await engine.drain()
    await engine.cleanup()


async def test_a_consumer_that_leaves_aborts_and_abort_hook_aborts() -> None:
    engine = make_engine()
    engine.fake_options = {"delay": 0.01}
    await engine.start()
    ctx = Context("gone")
    gen = engine.generate(request(1000), ctx)
    await gen.__anext__()
    await gen.aclose()
    assert engine.fake.tokenizer_manager.aborted == ["gone"]

    ctx2 = Context("hooked")
    gen2 = engine.generate(request(1000), ctx2)
    await gen2.__anext__()
    await engine.abort(ctx2)
    rest = [out async for out in gen2]
    assert rest[-1].finish_reason == "cancelled"
    assert engine.fake.tokenizer_manager.aborted == ["gone", "hooked"]
    await engine.cleanup()


async def test_engine_level_abort_request_is_used_without_a_tokenizer_manager() -> None:
    engine = make_engine()
    engine.fake_options = {"delay": 0.01}
    await engine.start()
    seen: list[str] = []
    fake = engine.fake

    async def abort_request(rid: str = "", abort_all: bool = False) -> None:
        seen.append(rid)
        fake.abort_flags.add(rid)

    del fake.tokenizer_manager
    fake.abort_request = abort_request
    ctx = Context("engine-abort")
    outs = []
    async for out in engine.generate(request(1000), ctx):
        outs.append(out)
        ctx.stop_generating()
    assert outs[-1].finish_reason == "cancelled"
    await asyncio.sleep(0)
    assert seen == ["engine-abort"]
    await engine.cleanup()


async def test_stopped_before_it_starts() -> None:
    engine = make_engine()
    await engine.start()
    ctx = Context()
    ctx.stop_generating()
    outs = await collect(engine, request(3), ctx)
    assert [o.finish_reason for o in outs] == ["cancelled"] and engine.fake.calls == []
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
    with pytest.raises(EngineShutdown):
        await engine.start()


# ---- KV events ----------------------------------------------------------------------------------


# ---- disaggregated prefill/decode -----------------------------------------------------------


def test_disaggregation_mode_needs_a_transfer_backend(
    model: LocalModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for mode in ("prefill", "decode"):
        with pytest.raises(SglangError, match=f"{mode}: .* add disaggregation_transfer_backend"):
            server_args_from_settings(EngineSettings(disaggregation_mode=mode), model)
    extra = tmp_path / "args.json"
    extra.write_text(json.dumps({"disaggregation_transfer_backend": "nixl"}))
    args = server_args_from_settings(
        EngineSettings(
            disaggregation_mode="prefill", extra_engine_args=extra, disaggregation_bootstrap_port=9123
        ),
        model,
    )
    assert (args["disaggregation_mode"], args["disaggregation_transfer_backend"]) == ("prefill", "nixl")
    assert args["disaggregation_bootstrap_port"] == 9123  # the port the graph compiler gave this worker
    assert "host" not in args
    monkeypatch.setenv("SGLANG_HOST_IP", "10.0.0.7")  # the host's address, by the graph compiler
    prefill = EngineSettings(disaggregation_mode="prefill", extra_engine_args=extra)
    assert server_args_from_settings(prefill, model)["host"] == "10.0.0.7"  # the bootstrap server binds there
    assert SglangEngine(args).kv_transfer
    extra.write_text(json.dumps({"disaggregation_mode": "prefill"}))
    with pytest.raises(
        SglangError, match="--disaggregation-mode agg conflicts with disaggregation_mode='prefill'"
    ):
        server_args_from_settings(EngineSettings(extra_engine_args=extra), model)
    assert not SglangEngine(server_args_from_settings(EngineSettings(), model)).kv_transfer


PD = {"disaggregation_transfer_backend": "nixl"}


def pd_engine(mode: str, **server_args: Any) -> FakeSglangEngine:
    return make_engine(disaggregation_mode=mode, **PD, **server_args)


async def test_a_prefill_engine_reports_its_bootstrap_address_for_its_card() -> None:
    prefiller = pd_engine("prefill", dist_init_addr="10.1.2.3:5000", disaggregation_bootstrap_port=9000)
    decoder = pd_engine("decode")
    configs = [await prefiller.start(), await decoder.start()]
    assert (configs[0].bootstrap_host, configs[0].bootstrap_port) == ("10.1.2.3", 9000)
    assert [bootstrap_address(runtime_config(c)) for c in configs] == [("10.1.2.3", 9000), None]
    for engine, config in zip((prefiller, decoder), configs, strict=True):
        # Neither half serves a request without its room ...
        with pytest.raises(EngineError, match="only serves requests paired by a bootstrap room"):
            engine.generate(request(5), Context())
        # ... but its health check runs alone, under SGLang's fake bootstrap host (its warmup).
        probe = msgspec.convert(engine.health_check_request(config), PreprocessedRequest)
        assert probe.bootstrap_info is not None and probe.bootstrap_info.host == "2.2.2.2"
        await engine.cleanup()


class Pool:
    """Workers as the frontend's router sees them: each behind the worker's request handler, the
    request crossing as msgpack (as on the request plane), errors tagged with the instance."""

    def __init__(self, engines: dict[int, SglangEngine]) -> None:
        self.engines = engines
        self.handlers = {i: tokens_handler(e) for i, e in engines.items()}
        self.sent: list[tuple[int, PreprocessedRequest]] = []
        self.down: set[int] = set()  # instances that cannot be reached

    def instance_ids(self) -> list[int]:
        return list(self.handlers)

    async def generate(
        self, request: PreprocessedRequest, context: Context, *, exclude=None, on_route=None
    ) -> Any:
        instance = next(i for i in self.handlers if not exclude or i not in exclude)
        if instance in self.down:
            err = CannotConnect(f"instance {instance:x} is down")
            err.instance_id = instance  # type: ignore[attr-defined]
            raise err
        if on_route is not None:
            on_route(instance, request)
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=PreprocessedRequest)
        self.sent.append((instance, wire))
        try:
            async for out in self.handlers[instance](wire, context):
                yield out
        except RequestError as err:
            err.instance_id = instance  # type: ignore[attr-defined]
            raise


class Counts:
    def __init__(self) -> None:
        self.prefills: list[tuple[str, str]] = []

    def prefill(self, model: str, where: str, reason: str) -> None:
        self.prefills.append((where, reason))

    def kv_import(self, model: str, report: Any) -> None:
        raise AssertionError("paired requests import no KV through the frontend")


async def disagg(prefill: dict[int, SglangEngine], decode: dict[int, SglangEngine], **config: Any) -> Any:
    """The frontend's DisaggRouter over started engines, the prefill workers' bootstrap addresses
    read from their cards' runtime_config as the model watcher reads them."""
    router = DisaggRouter(Pool(decode), DisaggConfig(**config), model="tiny", hooks=Counts())
    router.prefill = Pool(prefill)
    bootstraps = {}
    for instance, engine in {**prefill, **decode}.items():
        address = bootstrap_address(runtime_config(await engine.start()))
        if address is not None:
            bootstraps[instance] = address
    router.bootstraps = bootstraps
    return router


async def test_disaggregated_sglang_sends_both_halves_at_once_with_the_prefill_workers_bootstrap() -> None:
    prefiller = pd_engine("prefill", dist_init_addr="10.1.2.3:5000", disaggregation_bootstrap_port=9000)
    decoder = pd_engine("decode")
    router = await disagg({0xA: prefiller}, {0xD: decoder})
    outs = [out async for out in router.generate(request(5), Context())]
    assert tokens(outs) == [100, 101, 102, 103, 104] and outs[-1].finish_reason == "length"
    (instance, to_prefill), (_, to_decode) = router.prefill.sent[0], router.decode.sent[0]
    assert instance == 0xA and to_prefill.bootstrap_info == to_decode.bootstrap_info
    info = to_decode.bootstrap_info
    assert (info.host, info.port) == ("10.1.2.3", 9000) and 0 <= info.room < 2**63
    assert to_prefill.stop_conditions.max_tokens == 1 and to_decode.stop_conditions.max_tokens == 5
    assert to_decode.token_ids == to_prefill.token_ids == request(5).token_ids  # the prompt alone
    # SGLang got both halves with the same bootstrap triple and paired them.
    triple = {"bootstrap_host": "10.1.2.3", "bootstrap_port": 9000, "bootstrap_room": info.room}
    for fake in (prefiller.fake, decoder.fake):
        assert {k: fake.calls[0][k] for k in triple} == triple
    assert prefiller.fake.calls[0]["sampling_params"]["max_new_tokens"] == 1
    assert router.hooks.prefills == [("remote", "prefill_worker")]
    await asyncio.wait_for(asyncio.gather(*router._prefills), 5)  # the prefill's stream ended too
    # A second request draws another room.
    await anext(router.generate(request(2), Context()))
    assert router.decode.sent[1][1].bootstrap_info.room != info.room
    for engine in (prefiller, decoder):
        await engine.cleanup()


async def test_a_failed_prefill_abandons_its_decode_and_the_pair_is_tried_on_the_next_prefill_worker() -> (
    None
):
    broken = pd_engine("prefill", dist_init_addr="10.0.0.1:5000", disaggregation_bootstrap_port=9001)
    good = pd_engine("prefill", dist_init_addr="10.0.0.2:5000", disaggregation_bootstrap_port=9002)
    decoder = pd_engine("decode")
    router = await disagg({0xA: broken, 0xB: good}, {0xD: decoder})
    broken.fake.transfer_fails = True
    outs = [out async for out in router.generate(request(4), Context())]
    assert tokens(outs) == [100, 101, 102, 103]
    assert [i for i, _ in router.prefill.sent] == [0xA, 0xB]
    first, second = (r.bootstrap_info for _, r in router.decode.sent)
    assert (first.port, second.port) == (9001, 9002) and first.room != second.room
    # The decode request that waited for the broken prefill's KV was aborted in SGLang.
    assert decoder.fake.tokenizer_manager.aborted == [decoder.fake.calls[0]["rid"]]
    assert router.hooks.prefills == [("remote", "prefill_worker")]
    for engine in (broken, good, decoder):
        await engine.cleanup()


async def test_when_no_prefill_worker_can_be_reached_the_decode_pool_prefills_or_enforce_refuses() -> None:
    down = pd_engine("prefill", dist_init_addr="10.0.0.1:5000", disaggregation_bootstrap_port=9001)
    aggregated = make_engine()  # a decode pool that can prefill: as for other engines, it does
    router = await disagg({0xA: down}, {0xC: aggregated})
    router.prefill.down.add(0xA)
    outs = [out async for out in router.generate(request(3), Context())]
    assert tokens(outs) == [100, 101, 102]
    assert router.hooks.prefills == [("local", "prefill_failed")]
    assert [r.bootstrap_info for _, r in router.decode.sent] == [None]  # an ordinary request
    enforced = await disagg({0xA: down}, {0xC: aggregated}, enforce=True)
    enforced.prefill.down.add(0xA)
    with pytest.raises(NoPrefillWorkers, match="every prefill worker of 'tiny' failed"):
        [out async for out in enforced.generate(request(3), Context())]
    assert enforced.decode.sent == []
    # An SGLang decode engine cannot prefill locally: with its paired prefill failing and no
    # other prefill worker, the request fails with that engine's error.
    broken = pd_engine("prefill", dist_init_addr="10.0.0.1:5000", disaggregation_bootstrap_port=9001)
    decoder = pd_engine("decode")
    alone = await disagg({0xA: broken}, {0xD: decoder})
    broken.fake.transfer_fails = True
    with pytest.raises(EngineError, match="cannot prefill locally"):
        [out async for out in alone.generate(request(3), Context())]
    assert alone.hooks.prefills == [("local", "prefill_failed")]
    for engine in (down, aggregated, broken, decoder):
        await engine.cleanup()


async def test_a_client_that_leaves_aborts_the_decode_in_sglang() -> None:
    prefiller = pd_engine("prefill", dist_init_addr="10.1.2.3:5000", disaggregation_bootstrap_port=9000)
    decoder = pd_engine("decode")
    router = await disagg({0xA: prefiller}, {0xD: decoder})
    decoder.fake.delay = 0.01
    context = Context()
    stream = router.generate(request(50), context)
    await anext(stream)
    context.stop_generating()
    await stream.aclose()
    for _ in range(100):  # the handler's abort watcher runs on its own task
        if decoder.fake.tokenizer_manager.aborted:
            break
        await asyncio.sleep(0.01)
    assert decoder.fake.tokenizer_manager.aborted == [decoder.fake.calls[0]["rid"]]
    assert not router._prefills  # nothing of the request is left behind
    for engine in (prefiller, decoder):
        await engine.cleanup()


def test_kv_bridge_converts_sglang_batches() -> None:
    from dynamo_graph.engines.sglang.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    sink = RecordingSink()
    bridge = SglangKvEventBridge(sink, block_size=4)
    toks = list(range(10))  # two full blocks and a partial one
    bridge.handle_batch(
        KVEventBatch(
            ts=time.time(),
            events=[
                BlockStored(block_hashes=[11, 12, 13], parent_block_hash=-5, token_ids=toks, block_size=4),
                BlockRemoved(block_hashes=[13, 12]),
                AllBlocksCleared(),
            ],
        ),
        dp_rank=1,
    )
    local = local_block_hashes(toks, 4)
    assert sink.events == [
        ("stored", (-5) & ((1 << 64) - 1), [StoredBlock(11, local[0]), StoredBlock(12, local[1])], 1),
        ("removed", [12], 1),  # 13 was a partial block the router never saw
        ("cleared", 1),
    ]


# ---- the engine conformance kit -----------------------------------------------------------------


def _conformance_engine() -> FakeSglangEngine:
    engine = make_engine()
    engine.fake_options = {"delay": 0.001}
    return engine


test_conformance = conformance_tests(_conformance_engine, request, concurrency=4)
