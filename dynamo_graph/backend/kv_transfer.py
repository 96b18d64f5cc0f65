"""Disaggregated prefill/decode: moving a prompt's KV cache from a prefill worker to a decode worker.

The contract with engines (backend/engine.py): an engine with `kv_transfer = True` can
`prefill(request)` — compute the prompt, sample the first token, and hand back its KV state as
a `KvHandoff` (opaque bytes in the engine's own format) — and `generate_from_kv(request,
handoff)` — load such a state into a free sequence and go on generating without evaluating the
prompt again. Everything between the two is the worker's, not the engine's:

- The prefill worker keeps each handoff in a `KvStore` (bounded in bytes, entries expire after
  a TTL: a decode worker that never comes must not pin memory) under a fresh transfer id, and
  serves it on its component's `kv_fetch` endpoint over our own request plane — worker to worker,
  never through the frontend. A handoff is fetched once, in chunks, then dropped.
- The decode worker, given `kv_transfer_params` with a request, fetches the bytes from that
  instance (`KvFetcher`), within a timeout, and checks the format and size. Anything that goes
  wrong (the prefill worker gone, the entry expired, a timeout, a format the engine does not
  take) makes it prefill locally instead — the request does not fail — and the first chunk's
  `kv_import` report says what happened, for the frontend's metrics.

Settings (environment, so every worker of a graph can be given them): DYN_KV_TRANSFER_MAX_MB
(default 1024) caps the bytes a prefill worker holds; DYN_KV_TRANSFER_TTL_S (default 30) is how
long it holds one; DYN_KV_TRANSFER_TIMEOUT_S (default 10) bounds a decode worker's fetch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dynamo_graph.backend.errors import EngineOverloaded, ModelNotFound
from dynamo_graph.llm.protocol import KvImportReport, KvTransferParams
from dynamo_graph.runtime.client import Client
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.env import env_float
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)
KV_FETCH_ENDPOINT = "kv_fetch"
CHUNK_BYTES = 1 << 20


class KvHandoff(msgspec.Struct):
    """An engine's KV state after prefill. `format` names the engine's encoding (import refuses
    another); `num_tokens` prompt tokens are covered; `nbytes` is what the transfer stands for
    when `data` is a stand-in (the mocker simulates a cache it does not have), else len(data)."""

    format: str
    num_tokens: int
    data: bytes = b""
    nbytes: int | None = None

    @property
    def size(self) -> int:
        return len(self.data) if self.nbytes is None else self.nbytes


class KvStore:
    """Handoffs waiting for their decode worker: at most `max_bytes` held, each for `ttl_s`."""

    def __init__(self, max_bytes: int | None = None, ttl_s: float | None = None) -> None:
        self.max_bytes = max_bytes or int(
            env_float("DYN_KV_TRANSFER_MAX_MB", 1024, allow_zero=False) * (1 << 20)
        )
        self.ttl_s = ttl_s or env_float("DYN_KV_TRANSFER_TTL_S", 30.0, allow_zero=False)
        self._entries: OrderedDict[str, tuple[float, KvHandoff]] = OrderedDict()
        self.held_bytes = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, handoff: KvHandoff) -> str:
        """Hold `handoff`; its transfer id. Raises EngineOverloaded when it cannot fit even after
        dropping what expired (the frontend then prefills elsewhere or locally)."""
        self._expire()
        size = len(handoff.data)
        if self.held_bytes + size > self.max_bytes:
            raise EngineOverloaded(
                f"the prefill worker holds {self.held_bytes} bytes of KV waiting for decode workers "
                f"(limit {self.max_bytes}, DYN_KV_TRANSFER_MAX_MB)"
            )
        transfer_id = uuid.uuid4().hex
        self._entries[transfer_id] = (time.monotonic() + self.ttl_s, handoff)
        self.held_bytes += size
        return transfer_id

    def take(self, transfer_id: str) -> KvHandoff | None:
        """The handoff, removed from the store (it is fetched once), or None if unknown/expired."""
        self._expire()
        entry = self._entries.pop(transfer_id, None)
        if entry is None:
            return None
        self.held_bytes -= len(entry[1].data)
        return entry[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            transfer_id, (deadline, handoff) = next(iter(self._entries.items()))
            if deadline > now:
                return
            del self._entries[transfer_id]
            self.held_bytes -= len(handoff.data)
            self.expired += 1
            log.info("KV transfer %s expired unfetched after %.0fs", transfer_id, self.ttl_s)


def kv_fetch_handler(store: KvStore):
    """The prefill worker's `kv_fetch` endpoint: {"transfer_id"} in; a header
    {format, num_tokens, nbytes, size} then the data in CHUNK_BYTES pieces out."""

    async def fetch(request: dict[str, Any]) -> AsyncIterator[Any]:
        transfer_id = str(request.get("transfer_id", ""))
        handoff = store.take(transfer_id)
        if handoff is None:
            raise ModelNotFound(f"KV transfer {transfer_id!r} is not held here (expired or fetched)")
        data = handoff.data
        yield {
            "format": handoff.format,
            "num_tokens": handoff.num_tokens,
            "nbytes": handoff.size,
            "size": len(data),
        }
        view = memoryview(data)
        for start in range(0, len(data), CHUNK_BYTES):
            yield bytes(view[start : start + CHUNK_BYTES])

    return fetch


class KvFetchError(Exception):
    """Why a decode worker could not get a transfer's KV (it then prefills locally)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class KvFetcher:
    """A decode worker's side: fetch a transfer's handoff from the prefill instance that holds
    it, with one client per prefill component, kept for the worker's life."""

    def __init__(self, runtime: DistributedRuntime, timeout_s: float | None = None) -> None:
        self.runtime = runtime
        self.timeout_s = timeout_s or env_float("DYN_KV_TRANSFER_TIMEOUT_S", 10.0, allow_zero=False)
        self._clients: dict[tuple[str, str], Client] = {}

    async def _client(self, params: KvTransferParams) -> Client:
        key = (params.namespace, params.component)
        client = self._clients.get(key)
        if client is None:
            name = EndpointName(params.namespace, params.component, KV_FETCH_ENDPOINT)
            client = self._clients[key] = Client(self.runtime, name)
            await client.start()
        return client

    async def fetch(
        self, params: KvTransferParams, request: Context | None = None
    ) -> tuple[KvHandoff, KvImportReport]:
        """The transfer's KV; the fetch joins `request`'s trace."""
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                handoff = await self._fetch(params, request)
        except TimeoutError:
            message = f"no KV from {params.instance_id:x} within {self.timeout_s:g}s"
            raise KvFetchError("timeout", message) from None
        except KvFetchError:
            raise
        except Exception as err:  # the instance is gone, refused, or the stream broke
            raise KvFetchError("fetch_failed", f"{type(err).__name__}: {err}") from err
        if handoff.format != params.format or handoff.num_tokens != params.num_tokens:
            got = f"{handoff.format}/{handoff.num_tokens}"
            announced = f"{params.format}/{params.num_tokens}"
            raise KvFetchError("mismatch", f"fetched {got}, not the {announced} announced")
        return handoff, KvImportReport(nbytes=handoff.size, seconds=round(time.monotonic() - start, 6))

    async def _fetch(self, params: KvTransferParams, request: Context | None) -> KvHandoff:
        client = await self._client(params)
        while params.instance_id not in client.instances:  # a fresh client learns of it first
            await client.wait_for_change()
        header: dict[str, Any] | None = None
        parts: list[bytes] = []
        context = Context()
        context.trace = None if request is None else request.trace
        wanted = {"transfer_id": params.transfer_id}
        async for item in client.generate(wanted, instance_id=params.instance_id, context=context):
            if header is None:
                header = item
            else:
                parts.append(item)
        if header is None:
            raise KvFetchError("fetch_failed", "the prefill worker sent no KV")
        data = b"".join(parts)
        if len(data) != header["size"]:
            raise KvFetchError("fetch_failed", f"got {len(data)} of {header['size']} KV bytes")
        return KvHandoff(header["format"], header["num_tokens"], data, header["nbytes"])

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
