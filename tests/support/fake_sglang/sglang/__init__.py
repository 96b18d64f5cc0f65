"""A fake `sglang` (see README.md): `Engine(**server_args)` with `async_generate`,
`tokenizer_manager.abort_request`, `get_server_info` and `shutdown`, and SGLang's PD pairing. A
prefill engine listens on its bootstrap port (at ServerArgs' host, as SGLang's bootstrap server);
a decode request connects to the bootstrap host and port it was given and names its room; the
prefill request of that room "sends the KV" (a line back), or fails to when
FAKE_SGLANG_TRANSFER_FAILS is set; only then does the decode request stream. A request under
SGLang's fake bootstrap host runs alone (its warmup, our health checks). Every request is logged
as a JSON line to $FAKE_SGLANG_LOG, for the test to read."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from typing import Any

FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class _TokenizerManager:
    def __init__(self) -> None:
        self.aborted: set[str] = set()
        self.context_len = 4096

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.add(rid)


class Engine:
    def __init__(self, **server_args: Any) -> None:
        self.args = server_args
        self.mode = server_args.get("disaggregation_mode")
        self.tokenizer_manager = _TokenizerManager()
        self.rooms: dict[int, asyncio.Future[asyncio.StreamWriter]] = {}
        self.server: asyncio.AbstractServer | None = None
        if self.mode == "prefill":  # SGLang's bootstrap server: bound now, served on the loop
            address = (
                server_args.get("host") or "127.0.0.1",
                int(server_args["disaggregation_bootstrap_port"]),
            )
            sock = socket.create_server(address)
            self._serving = asyncio.get_event_loop().create_task(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        self.server = await asyncio.start_server(self._joined, sock=sock)

    async def _joined(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        room = int((await reader.readline()).decode())
        self._room(room).set_result(writer)

    def _room(self, room: int) -> asyncio.Future[asyncio.StreamWriter]:
        return self.rooms.setdefault(room, asyncio.get_running_loop().create_future())

    def get_server_info(self) -> dict[str, Any]:
        return {"max_total_num_tokens": 8192, "max_running_requests": 16}

    async def async_generate(self, **kwargs: Any) -> Any:
        log = os.environ.get("FAKE_SGLANG_LOG")
        if log:
            fields = ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")
            record = {"mode": self.mode, **{k: kwargs.get(k) for k in fields}}
            record["max_new_tokens"] = kwargs["sampling_params"].get("max_new_tokens")
            with Path(log).open("a") as f:  # noqa: ASYNC230 - one short line, in a test double
                f.write(json.dumps(record) + "\n")
        self.tokenizer_manager.aborted.discard(kwargs["rid"])
        return self._stream(**kwargs)

    async def _stream(self, input_ids, sampling_params, rid, bootstrap_room=None, **kwargs: Any) -> Any:
        limit = sampling_params.get("max_new_tokens", 16)
        alone = kwargs.get("bootstrap_host") == FAKE_BOOTSTRAP_HOST  # SGLang's warmup: no pairing
        if self.mode == "prefill" and not alone:
            joined = self._room(bootstrap_room)
            while not joined.done():  # until the decode request joins, or ours is aborted
                await asyncio.wait({joined}, timeout=0.01)
                if rid in self.tokenizer_manager.aborted:
                    yield {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
                    return
            writer = self.rooms.pop(bootstrap_room).result()
            fails = bool(os.environ.get("FAKE_SGLANG_TRANSFER_FAILS"))
            writer.write(b"fail\n" if fails else b"kv\n")
            await writer.drain()
            writer.close()
            if fails:
                raise RuntimeError(f"KVTransferError(bootstrap_room={bootstrap_room}): transfer failed")
            limit = 1
        elif self.mode == "decode" and not alone:
            reader, writer = await asyncio.open_connection(kwargs["bootstrap_host"], kwargs["bootstrap_port"])
            writer.write(f"{bootstrap_room}\n".encode())
            await writer.drain()
            sent = (await reader.readline()).strip() == b"kv"
            writer.close()
            if not sent:
                yield {
                    "output_ids": [],
                    "meta_info": {"finish_reason": {"type": "abort", "message": "KV transfer failed"}},
                }
                return
        stop = set(sampling_params.get("stop_token_ids") or ())
        for i in range(limit):
            await asyncio.sleep(0.001)
            if rid in self.tokenizer_manager.aborted:
                yield {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
                return
            token = 100 + i
            finish = None
            if token in stop:
                finish = {"type": "stop", "matched": token}
            elif i + 1 == limit:
                finish = {"type": "length", "length": limit}
            yield {"output_ids": [token], "meta_info": {"finish_reason": finish, "cached_tokens": 0}}
            if finish is not None:
                return

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
