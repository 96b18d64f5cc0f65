"""LoRA adapters an engine serves beside its base model, each under its own model name.

A worker's engine loads an adapter (`LLMEngine.load_lora`), and the worker then publishes a
model card for it — the base card under the adapter's name, with `lora` naming the base model —
at `v1/mdc/{ns}/{comp}/{ep}/{instance_id:x}/{adapter slug}`, under the worker's lease. A
frontend's model watcher turns that card into a model routed only to the workers that published
it; unloading deletes the card, and the model leaves `/v1/models` with its last worker.

Adapters come from the worker's command line (`--lora-modules NAME=PATH,...`, what a graph's
`lora_adapters` compile to) or at run time through the worker's `lora` endpoint, which the
frontend's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` call (frontend/lora.py).
Engines see an adapter's requests by their `model`: the adapter's name. In-process serving
(`dyngraph run in=http out=ENGINE`) uses the same manager, publishing to the frontend's registry
instead (inputs/lora_local.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from xxhash import xxh3_64_intdigest

from dynamo_graph.backend.errors import EngineError, InvalidArgument, ModelNotFound
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.llm.card import LORA_ENDPOINT, ModelDeploymentCard, slugify

if TYPE_CHECKING:
    from dynamo_graph.runtime.runtime import Endpoint

log = logging.getLogger(__name__)
__all__ = [
    "LORA_ENDPOINT",
    "LoraAdapter",
    "LoraManager",
    "discovery_publisher",
    "lora_handler",
    "parse_lora_modules",
]

MAX_NAME_LEN = 256
_NAME = re.compile(r"^[^\s/]+$")


class LoraAdapter(msgspec.Struct, frozen=True):
    """An adapter as engines load it. `lora_id`: a stable positive integer per name (vLLM's
    `lora_int_id`), equal on every worker so that their KV events agree."""

    name: str
    path: str
    lora_id: int


class AdapterEngine(Protocol):
    """What the manager needs of an engine (`LLMEngine` has both, refusing by default)."""

    async def load_lora(self, adapter: LoraAdapter) -> None: ...

    async def unload_lora(self, name: str) -> None: ...


class LoraControl(msgspec.Struct, omit_defaults=True):
    """A request to the worker's `lora` endpoint."""

    action: str  # load | unload | list
    lora_name: str | None = None
    lora_path: str | None = None


def lora_id(name: str) -> int:
    """A positive 31-bit id from the adapter's name (vLLM wants lora_int_id > 0)."""
    return (xxh3_64_intdigest(name.encode()) & 0x7FFF_FFFF) or 1


def check_adapter_name(name: Any, base_model: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgument("lora_name must be a non-empty string", param="lora_name")
    if len(name) > MAX_NAME_LEN or not _NAME.match(name):
        raise InvalidArgument(
            f"lora_name {name[:80]!r} must be at most {MAX_NAME_LEN} characters without spaces or '/'",
            param="lora_name",
        )
    if name == base_model:
        raise InvalidArgument(f"lora_name {name!r} is the base model's own name", param="lora_name")
    return name


def parse_lora_modules(text: str | None) -> list[tuple[str, str]]:
    """`--lora-modules NAME=PATH[,NAME=PATH...]` as (name, path) pairs."""
    pairs: list[tuple[str, str]] = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise RunConfigError(f"--lora-modules: {item.strip()!r} is not NAME=PATH")
        pairs.append((name.strip(), path.strip()))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise RunConfigError(f"--lora-modules: an adapter name is given twice ({', '.join(names)})")
    return pairs


# Makes an adapter's card known (a worker: in discovery; in-process serving: to the frontend's
# registry), or with None, withdraws it.
Publish = Callable[[str, ModelDeploymentCard | None], Awaitable[None]]


class LoraManager:
    """The adapters one engine serves: loads them into it and publishes their cards."""

    def __init__(self, engine: AdapterEngine, card: ModelDeploymentCard, publish: Publish) -> None:
        self.engine = engine
        self.card = card
        self.publish = publish
        self.adapters: dict[str, LoraAdapter] = {}
        self._lock = asyncio.Lock()  # one load/unload at a time: engines are not re-entrant here

    async def load(self, name: Any, path: Any) -> tuple[LoraAdapter, bool]:
        """Load and publish the adapter; (adapter, False) when it was loaded already from the
        same path. A name in use with another path, or a bad path, is an InvalidArgument."""
        name = check_adapter_name(name, self.card.display_name)
        if not isinstance(path, str) or not path:
            raise InvalidArgument("lora_path must be a non-empty string", param="lora_path")
        async with self._lock:
            loaded = self.adapters.get(name)
            if loaded is not None:
                if loaded.path != path:
                    raise InvalidArgument(
                        f"The lora adapter {name!r} is already loaded from {loaded.path}", param="lora_name"
                    )
                return loaded, False
            clash = next((a for a in self.adapters if slugify(a) == slugify(name)), None)
            if clash is not None:
                raise InvalidArgument(
                    f"lora_name {name!r} and the loaded {clash!r} have the same slug", param="lora_name"
                )
            if not await asyncio.to_thread(Path(path).exists):
                raise InvalidArgument(f"lora_path {path!r} does not exist on this worker", param="lora_path")
            adapter = LoraAdapter(name, path, lora_id(name))
            await self.engine.load_lora(adapter)
            self.adapters[name] = adapter
            await self.publish(name, self.card.for_adapter(name, path))
            log.info("LoRA adapter %r loaded from %s (id %d)", name, path, adapter.lora_id)
            return adapter, True

    async def unload(self, name: Any) -> LoraAdapter:
        """Withdraw the adapter's card first (no new requests), then unload it from the engine."""
        async with self._lock:
            adapter = self.adapters.get(name) if isinstance(name, str) else None
            if adapter is None:
                raise ModelNotFound(f"The lora adapter {name!r} is not loaded here", param="lora_name")
            await self.publish(adapter.name, None)
            del self.adapters[adapter.name]
            await self.engine.unload_lora(adapter.name)
            log.info("LoRA adapter %r unloaded", adapter.name)
            return adapter

    async def load_declared(self, lora_modules: str | None) -> None:
        """The adapters of `--lora-modules`; a RunConfigError names the one that failed."""
        for name, path in parse_lora_modules(lora_modules):
            try:
                await self.load(name, path)
            except EngineError as err:
                raise RunConfigError(f"--lora-modules {name}={path}: {err.message}") from None


def discovery_publisher(endpoint: Endpoint) -> Publish:
    """A worker's adapter cards: one key below its own card, under its lease."""

    async def publish(name: str, card: ModelDeploymentCard | None) -> None:
        discovery = endpoint.runtime.discovery
        assert discovery is not None, "adapter cards need discovery"
        key = endpoint.name.card_key(endpoint.instance_id, slugify(name))
        if card is None:
            await discovery.delete(key)
        else:
            await discovery.put(key, card.to_json())

    return publish


def lora_handler(manager: LoraManager):
    """The worker's `lora` endpoint: a LoraControl in, one answer out."""

    async def control(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            msg = msgspec.convert(request, LoraControl)
        except msgspec.ValidationError as err:
            raise InvalidArgument(f"bad lora control request: {err}") from None
        if msg.action == "load":
            adapter, fresh = await manager.load(msg.lora_name, msg.lora_path)
            yield {"lora_name": adapter.name, "lora_id": adapter.lora_id, "loaded": fresh}
        elif msg.action == "unload":
            adapter = await manager.unload(msg.lora_name)
            yield {"lora_name": adapter.name, "lora_id": adapter.lora_id}
        elif msg.action == "list":
            yield {"adapters": [msgspec.to_builtins(a) for a in manager.adapters.values()]}
        else:
            raise InvalidArgument(f"unknown lora action {msg.action!r} (load, unload, list)", param="action")

    return control
