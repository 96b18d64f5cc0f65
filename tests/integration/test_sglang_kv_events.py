"""out=sglang's KV events over real ZMQ sockets: SGLang's publisher (played here by a PUB socket
sending msgpack arrays in SGLang's wire layout) reaches the sink through the adapter's SUB socket.
The engine itself is replaced at its API boundary (no sglang here); the rest of the adapter:
tests/unit/test_sglang_adapter.py and test_adapter_contract.py."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

from dynamo_graph.engines.sglang.engine import SglangEngine
from dynamo_graph.router.kv.hashing import local_block_hashes
from dynamo_graph.router.kv.protocols import StoredBlock
from tests.support.engine_adapters import RecordingSink

FIELDS = {"model_path", "skip_tokenizer_init", "page_size", "kv_events_config"}


class BackendlessSglang(SglangEngine):
    """Starts without SGLang: the KV event subscription is all these tests need."""

    def _server_args_fields(self) -> set[str]:
        return FIELDS

    def _create_backend(self, server_args: dict[str, Any]) -> Any:
        return SimpleNamespace(shutdown=lambda: None)


def make_engine(**server_args: Any) -> BackendlessSglang:
    return BackendlessSglang(
        {"model_path": "/m", "skip_tokenizer_init": True, "page_size": 4, **server_args},
        default_context_length=4096,
    )


def _wire_batch(events: list[list[Any]]) -> bytes:
    """A KVEventBatch as SGLang's publisher encodes it: msgpack arrays, tagged by class name."""
    return msgspec.msgpack.encode([time.time(), events])


async def test_kv_events_flow_from_sglangs_zmq_publisher() -> None:
    import zmq
    import zmq.asyncio

    sink = RecordingSink()
    engine = make_engine()
    engine.kv_event_sink = sink
    await engine.start()
    config = json.loads(engine.launched_args["kv_events_config"])
    assert config["publisher"] == "zmq" and config["endpoint"].startswith("tcp://127.0.0.1:")
    # SGLang's publisher connects to a concrete tcp address (kv_events.py) and sends [topic, seq, payload].
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(config["endpoint"])
    topic = config["topic"].encode()
    try:
        deadline = time.monotonic() + 5
        while not sink.events and time.monotonic() < deadline:  # the ZMQ handshake takes a moment
            await pub.send_multipart([topic, (0).to_bytes(8, "big"), _wire_batch([["AllBlocksCleared"]])])
            await asyncio.sleep(0.02)
        assert sink.events and sink.events[0] == ("cleared", 0)
        toks = list(range(8))
        stored = ["BlockStored", [7, 8], None, toks, 4, None, "GPU"]  # a newer trailing field is ignored
        await pub.send_multipart(
            [topic, (1).to_bytes(8, "big"), _wire_batch([stored, ["BlockRemoved", [7]]])]
        )
        for _ in range(500):
            if len([e for e in sink.events if e[0] != "cleared"]) >= 2:
                break
            await asyncio.sleep(0.01)
        local = local_block_hashes(toks, 4)
        others = [e for e in sink.events if e[0] != "cleared"]
        assert others == [
            ("stored", None, [StoredBlock(7, local[0]), StoredBlock(8, local[1])], 0),
            ("removed", [7], 0),
        ]
    finally:
        pub.close(linger=0)
        ctx.term()
    sink.events.clear()
    await engine.cleanup()
    assert sink.events == [("cleared", 0)]


async def test_kv_events_from_a_user_configured_binding_publisher(tmp_path: Path) -> None:
    import zmq
    import zmq.asyncio

    endpoint = f"ipc://{tmp_path / 'kv.sock'}"
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)  # SGLang binds ipc:// endpoints; we connect
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    sink = RecordingSink()
    engine = make_engine(
        kv_events_config=json.dumps({"publisher": "zmq", "endpoint": endpoint, "topic": "t"})
    )
    engine.kv_event_sink = sink
    try:
        await engine.start()
        deadline = time.monotonic() + 5
        while not sink.events and time.monotonic() < deadline:
            await pub.send_multipart([b"t", (0).to_bytes(8, "big"), _wire_batch([["AllBlocksCleared"]])])
            await asyncio.sleep(0.02)
        assert sink.events[0] == ("cleared", 0)
    finally:
        await engine.cleanup()
        pub.close(linger=0)
        ctx.term()
