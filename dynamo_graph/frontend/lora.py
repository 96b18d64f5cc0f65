"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's routes, for a graph.

vLLM's bodies (`{"lora_name", "lora_path"}`; `{"lora_name"}`) and answers (200 with a plain-text
"Success: ..." line; an OpenAI error body naming the field otherwise). The frontend asks the
workers of the base model, over the request plane, to load the adapter (their `lora` endpoint,
backend/lora.py); each then publishes the adapter's model card and the model watcher lists it
and routes it to them only. The answer waits until that has happened (up to
DYN_LORA_WAIT_S, default 10 s), so a client may use the adapter as soon as it has its 200.

In-process serving (`dyngraph run in=http out=ENGINE`) serves the same routes with its own
admin (inputs/lora_local.py). Two extensions, since a graph has many workers and may serve
several models: `base_model` (the model the adapter applies to; may be left out when the
frontend serves one base model) and `instance_ids` (hex, as /health shows them: load it on
these workers only; default: all the base model's workers). Unloading unloads it from every
worker that serves it. Both routes sit behind the API key when one is set (as every /v1/ route),
and take only the operator's keys (`--api-key`, `api_key_env`): a tenant's key of the keys file
is refused with 403, so no tenant loads or unloads what other tenants use (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from dynamo_graph.frontend.errors import HTTPError, from_decode_error, post_only
from dynamo_graph.frontend.model_watcher import ModelWatcher
from dynamo_graph.frontend.openai_asgi import Receive, Scope, Send, read_body, send_json
from dynamo_graph.frontend.tenants import TENANT_SCOPE
from dynamo_graph.llm.card import LORA_ENDPOINT
from dynamo_graph.runtime.client import Client
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.env import env_float
from dynamo_graph.runtime.errors import RequestError
from dynamo_graph.runtime.names import EndpointName

log = logging.getLogger(__name__)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
WAIT_S = 10.0  # for the model watcher to list (or drop) the adapter
CONTROL_TIMEOUT_S = 120.0  # a worker loading an adapter from disk
_POLL_S = 0.02


class LoadLoraAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    base_model: str | None = None
    instance_ids: list[str | int] | None = None
    load_inplace: bool = False  # vLLM's; reloading in place is not supported here


class UnloadLoraAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what identifies an adapter


def _instance_id(value: str | int) -> int:
    try:
        return value if isinstance(value, int) else int(value.removeprefix("0x"), 16)
    except ValueError:
        message = f"instance_ids: {value!r} is not a hex instance id"
        raise HTTPError(400, message, param="instance_ids") from None


class AdapterAdmin(Protocol):
    """What the routes call: LoraAdmin (workers found by discovery), or in-process serving's
    (inputs/lora_local.py). Each returns the success line, or raises HTTPError / RequestError."""

    async def load(self, request: LoadLoraAdapter) -> str: ...

    async def unload(self, request: UnloadLoraAdapter) -> str: ...


class LoraAdmin:
    """Loads and unloads adapters on the workers the model watcher knows."""

    def __init__(self, watcher: ModelWatcher, wait_s: float | None = None) -> None:
        self.watcher = watcher
        self.wait_s = env_float("DYN_LORA_WAIT_S", WAIT_S) if wait_s is None else wait_s
        self._clients: dict[tuple[str, str], Client] = {}
        self._lock = asyncio.Lock()  # one change at a time: no load racing its own unload

    async def _client(self, endpoint: EndpointName) -> Client:
        key = (endpoint.namespace, endpoint.component)
        client = self._clients.get(key)
        if client is None:
            name = EndpointName(endpoint.namespace, endpoint.component, LORA_ENDPOINT)
            client = self._clients[key] = Client(self.watcher.runtime, name)
            await client.start()
        return client

    async def _control(self, endpoint: EndpointName, instance_id: int, request: dict[str, Any]) -> Any:
        """One control request to one worker; its single answer."""
        client = await self._client(endpoint)
        async with asyncio.timeout(self.wait_s):
            while instance_id not in client.instances:  # a fresh client learns of it first
                await client.wait_for_change()
        stream = client.generate(
            request, instance_id=instance_id, context=Context(), timeout_s=CONTROL_TIMEOUT_S
        )
        answers = [answer async for answer in stream]
        return answers[-1] if answers else None

    def _base(self, request: LoadLoraAdapter) -> tuple[EndpointName, list[int], str]:
        watcher = self.watcher
        names = [n for n in watcher.registry.names() if (s := watcher.serving(n)) and s[2].lora is None]
        base = request.base_model
        if base is None:
            if len(names) != 1:
                served = ", ".join(names) or "none yet"
                raise HTTPError(
                    400, f"base_model is needed: this frontend serves {served}", param="base_model"
                )
            base = names[0]
        serving = self.watcher.serving(base)
        if serving is None or serving[2].lora is not None:
            raise HTTPError(
                404, f"The base model `{base}` does not exist.", param="base_model", code="model_not_found"
            )
        if serving[2].model_input != "tokens":
            raise HTTPError(
                400,
                f"`{base}` is served by a text-input engine: LoRA adapters need a tokens-input one",
                param="base_model",
            )
        return serving[0], serving[1], base

    async def load(self, request: LoadLoraAdapter) -> str:
        served = self.watcher.serving(request.lora_name)
        if served is not None and served[2].lora is None:
            raise HTTPError(400, f"`{request.lora_name}` is the name of a base model", param="lora_name")
        endpoint, workers, base = self._base(request)
        if served is not None and served[2].lora is not None and served[2].lora.base_model != base:
            message = f"`{request.lora_name}` is an adapter of `{served[2].lora.base_model}` already"
            raise HTTPError(400, message, param="lora_name")
        targets = workers
        if request.instance_ids is not None:
            targets = sorted({_instance_id(v) for v in request.instance_ids})
            unknown = [f"{i:x}" for i in targets if i not in workers]
            if unknown or not targets:
                raise HTTPError(
                    400,
                    f"instance_ids: {', '.join(unknown) or 'none given'} not among {base}'s workers "
                    f"({', '.join(f'{i:x}' for i in workers)})",
                    param="instance_ids",
                )
        if not targets:
            raise HTTPError(503, f"`{base}` has no workers to load the adapter on", code="no_instances")
        body = {"action": "load", "lora_name": request.lora_name, "lora_path": request.lora_path}
        async with self._lock:
            loaded: list[int] = []
            try:
                for instance_id in targets:
                    answer = await self._control(endpoint, instance_id, body)
                    if isinstance(answer, dict) and answer.get("loaded"):
                        loaded.append(instance_id)
            except Exception:
                await self._undo(endpoint, request.lora_name, loaded)
                raise
            name = request.lora_name
            await self._wait(lambda: set(targets) <= self.watcher.routable(name), name)
        log.info("LoRA adapter %r (on %s) loaded on %d worker(s)", request.lora_name, base, len(targets))
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def _undo(self, endpoint: EndpointName, name: str, instance_ids: list[int]) -> None:
        """Unload what a failed load had loaded, so no worker serves half a change."""
        for instance_id in instance_ids:
            try:
                await self._control(endpoint, instance_id, {"action": "unload", "lora_name": name})
            except Exception as err:
                log.warning("could not unload LoRA adapter %r from %x: %s", name, instance_id, err)

    async def unload(self, request: UnloadLoraAdapter) -> str:
        name = request.lora_name
        async with self._lock:
            serving = self.watcher.serving(name)
            if serving is None or serving[2].lora is None:
                message = f"The lora adapter `{name}` cannot be found."
                raise HTTPError(404, message, param="lora_name", code="model_not_found")
            endpoint, workers, _ = serving
            for instance_id in workers:
                await self._control(endpoint, instance_id, {"action": "unload", "lora_name": name})
            await self._wait(lambda: self.watcher.serving(name) is None, name)
            await self.watcher.forget(name)  # gone on purpose: 404 now, not after --model-wait-s
        log.info("LoRA adapter %r unloaded from %d worker(s)", name, len(workers))
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _wait(self, done: Callable[[], bool], name: str) -> None:
        deadline = time.monotonic() + self.wait_s
        while not done():
            if time.monotonic() > deadline:
                log.warning("LoRA adapter %r: the model list did not follow within %.0fs", name, self.wait_s)
                return
            await asyncio.sleep(_POLL_S)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


_LOAD = msgspec.json.Decoder(LoadLoraAdapter)
_UNLOAD = msgspec.json.Decoder(UnloadLoraAdapter)


TENANT_REFUSED = HTTPError(
    403,
    "A tenant's API key cannot load or unload LoRA adapters; use an operator's key (--api-key, api_key_env)",
    code="permission_denied",
)


class LoraRoutes:
    """The two routes as one raw ASGI handler (the app's dispatcher sends both paths here)."""

    def __init__(self, admin: AdapterAdmin, body_limit: int) -> None:
        self.admin = admin
        self.body_limit = body_limit

    def error_body(self, err: HTTPError) -> bytes:
        return err.body()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            refused = post_only()
            await send_json(send, 405, refused.body(), refused.headers)
            return
        if scope.get(TENANT_SCOPE) is not None:
            await send_json(send, 403, TENANT_REFUSED.body())
            return
        try:
            body = await read_body(receive, self.body_limit)
            if scope["path"].rstrip("/") == LOAD_PATH:
                load = _LOAD.decode(body)
                if load.load_inplace:
                    message = "load_inplace is not supported: unload the adapter, then load it"
                    raise HTTPError(400, message, param="load_inplace")
                message = await self.admin.load(load)
            else:
                message = await self.admin.unload(_UNLOAD.decode(body))
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            await send_json(send, 400, from_decode_error(err).body())
            return
        except HTTPError as err:
            await send_json(send, err.status, err.body())
            return
        except RequestError as err:  # a worker's answer: a bad path, a name in use, ...
            await send_json(send, err.http_status, HTTPError.from_engine_error(err).body())
            return
        except TimeoutError:
            late = HTTPError(504, "A worker did not answer in time", code="timeout")
            await send_json(send, 504, late.body())
            return
        headers = [(b"content-type", b"text/plain; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": message.encode()})


__all__ = ["LOAD_PATH", "UNLOAD_PATH", "AdapterAdmin", "LoraAdmin", "LoraRoutes"]
