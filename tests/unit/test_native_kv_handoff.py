"""Native KV connectors behind the KV transfer contract, without the engines' packages: the handoff of
a connector's transfer parameters (engines/kv_handoff.py) and how vLLM's `kv_transfer_config` follows
`--disaggregation-mode` (engines/vllm/disagg.py). vLLM for real: tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_graph.backend.engine import KvImportError
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput
from dynamo_graph.backend.settings import EngineSettings
from dynamo_graph.engines.kv_handoff import (
    connector_format,
    connector_handoff,
    connector_params,
    first_token_answer,
    first_token_request,
    prompt_digest,
    prompt_request,
    without_known,
)
from dynamo_graph.engines.vllm.args import VllmError, engine_args_from_settings
from dynamo_graph.engines.vllm.disagg import connector_name
from dynamo_graph.engines.vllm.engine import VllmEngine
from tests.support.engine_adapters import request, tiny_local_model

NIXL = connector_format("vllm", "NixlConnector")


def test_a_handoff_carries_the_parameters_for_its_prompt_only() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_host": "10.0.0.2"}
    handoff = connector_handoff(NIXL, [0, 10, 11, 12], params)
    assert (handoff.format, handoff.num_tokens) == ("vllm-connector/1:NixlConnector", 4)
    assert handoff.size == len(handoff.data) < 200  # the parameters, not the KV
    # The decode request is the prompt and what was generated since.
    assert connector_params(handoff, NIXL, [0, 10, 11, 12, 99]) == params
    assert connector_params(connector_handoff(NIXL, [5], None), NIXL, [5, 6]) is None
    with pytest.raises(KvImportError, match="not this request's"):
        connector_params(handoff, NIXL, [0, 10, 11, 13, 99])
    with pytest.raises(KvImportError, match="more than the request's"):
        connector_params(handoff, NIXL, [0, 10, 11])
    with pytest.raises(KvImportError, match="cannot be loaded by"):
        connector_params(handoff, connector_format("vllm", "ExampleConnector"), [0, 10, 11, 12])
    not_an_object = json.dumps({"params": 1, "prompt_sha256": prompt_digest([])}).encode()
    for data in (b"not json", not_an_object, b"{}"):
        with pytest.raises(KvImportError, match="malformed"):
            connector_params(KvHandoff(NIXL, 0, data), NIXL, [1])
    with pytest.raises(ValueError, match="not JSON"):
        connector_handoff(NIXL, [1], {"opaque": b"\x00"})


async def chunks(*outs: LLMEngineOutput) -> Any:
    for out in outs:
        yield out


async def test_first_token_answer_says_whether_the_request_goes_on() -> None:
    req = request(5, min_tokens=3)
    cut = first_token_request(req)
    assert (cut.stop_conditions.max_tokens, cut.stop_conditions.min_tokens) == (1, 1)
    assert req.stop_conditions.max_tokens == 5  # the request itself is left alone
    answer, goes_on = await first_token_answer(
        chunks(LLMEngineOutput(token_ids=[7], cached_tokens=2), LLMEngineOutput(finish_reason="length")), req
    )
    assert goes_on and answer.token_ids == [7] and answer.cached_tokens == 2
    assert answer.finish_reason is None and answer.completion_usage is None
    for reason, n in (("stop", 5), ("length", 1), ("cancelled", 5)):
        answer, goes_on = await first_token_answer(
            chunks(LLMEngineOutput([8], finish_reason=reason)), request(n)
        )
        assert not goes_on and answer.finish_reason == reason


async def test_a_continuation_runs_as_its_prompt_without_resending_what_the_client_has() -> None:
    follow = msgspec.structs.replace(request(4, min_tokens=2), token_ids=[0, 10, 11, 12, 100])
    prompt_only, known = prompt_request(follow, 4)
    assert (prompt_only.token_ids, known) == ([0, 10, 11, 12], [100])
    assert (prompt_only.stop_conditions.max_tokens, prompt_only.stop_conditions.min_tokens) == (5, 3)
    same, nothing = prompt_request(request(4), 4)
    assert nothing == [] and same.stop_conditions.max_tokens == 4

    def engine(*outs: LLMEngineOutput) -> Any:
        return without_known(chunks(*outs), known)

    outs = [
        out
        async for out in engine(
            LLMEngineOutput([100], cached_tokens=3),
            LLMEngineOutput([101, 102]),
            LLMEngineOutput([103], finish_reason="length", completion_usage=CompletionUsage(4, 4)),
        )
    ]
    assert [o.token_ids for o in outs] == [[101, 102], [103]]
    assert outs[0].cached_tokens == 3  # the dropped chunk's prefix hit moves to the first one sent
    usage = outs[-1].completion_usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (5, 3)
    closed: list[bool] = []

    async def mismatching() -> Any:
        try:
            yield LLMEngineOutput([7, 8])
            yield LLMEngineOutput([9])
        finally:
            closed.append(True)

    with pytest.raises(KvImportError, match=r"generated \[7\], not the prefill's \[100\]"):
        await anext(without_known(mismatching(), known))
    assert closed == [True]  # the engine's request ended with it, not when collected


def args_file(tmp_path: Path, **args: Any) -> Path:
    path = tmp_path / "args.json"
    path.write_text(json.dumps(args))
    return path


@pytest.mark.parametrize(
    ("mode", "role"), [("prefill", "kv_producer"), ("decode", "kv_consumer"), ("agg", "kv_both")]
)
def test_vllm_kv_role_follows_the_disaggregation_mode(tmp_path: Path, mode: str, role: str) -> None:
    model = tiny_local_model(tmp_path)
    transfer = {"kv_connector": "NixlConnector", "kv_buffer_device": "cuda"}
    for given in (transfer, json.dumps(transfer)):  # an object, or a JSON string as on vLLM's command line
        cfg = EngineSettings(
            disaggregation_mode=mode, extra_engine_args=args_file(tmp_path, kv_transfer_config=given)
        )
        args = engine_args_from_settings(cfg, model)
        assert args["kv_transfer_config"] == {**transfer, "kv_role": role}
        engine = VllmEngine(args)
        assert engine.kv_transfer and engine.connector == "NixlConnector"
        assert engine.kv_format == "vllm-connector/1:NixlConnector"


def test_vllm_disaggregation_needs_a_connector_with_a_matching_role(tmp_path: Path) -> None:
    model = tiny_local_model(tmp_path)
    for mode in ("prefill", "decode"):
        with pytest.raises(VllmError, match=f"--disaggregation-mode {mode}: .* add kv_transfer_config"):
            engine_args_from_settings(EngineSettings(disaggregation_mode=mode), model)
    no_connector = args_file(tmp_path, kv_transfer_config={"kv_role": "kv_producer"})
    with pytest.raises(VllmError, match="add kv_transfer_config"):
        engine_args_from_settings(
            EngineSettings(disaggregation_mode="prefill", extra_engine_args=no_connector), model
        )
    consumer = args_file(
        tmp_path, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    )
    with pytest.raises(VllmError, match="prefill conflicts with kv_role 'kv_consumer'"):
        engine_args_from_settings(
            EngineSettings(disaggregation_mode="prefill", extra_engine_args=consumer), model
        )
    both = args_file(tmp_path, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    args = engine_args_from_settings(
        EngineSettings(disaggregation_mode="decode", extra_engine_args=both), model
    )
    assert args["kv_transfer_config"]["kv_role"] == "kv_both"
    for bad, message in (("{not json", "is not JSON"), ([1], "must be a JSON object")):
        with pytest.raises(VllmError, match=message):
            engine_args_from_settings(
                EngineSettings(extra_engine_args=args_file(tmp_path, kv_transfer_config=bad)), model
            )
    # Aggregated without a connector: nothing added, and the engine cannot hand KV over.
    args = engine_args_from_settings(EngineSettings(), model)
    assert "kv_transfer_config" not in args and not VllmEngine(args).kv_transfer
    assert connector_name(None) is None and connector_name("{bad") is None
    assert connector_name(type("Config", (), {"kv_connector": "X"})()) == "X"
