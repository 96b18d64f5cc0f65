"""LoRA adapters in one process (`dyngraph run in=http out=ENGINE MODEL`), as vLLM's own server
serves them: `--lora-modules` load at start, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` load and unload at run time, and each adapter is a model of the
frontend's registry, a pipeline of its own around the one engine. The worker's LoraManager
(backend/lora.py) does the loading; here it publishes to the registry instead of discovery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.lora import LoraManager
from dynamo_graph.frontend.errors import HTTPError
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.pipeline import tokens_pipeline

if TYPE_CHECKING:
    from dynamo_graph.backend.worker import StartedEngine
    from dynamo_graph.frontend.lora import LoadLoraAdapter, UnloadLoraAdapter
    from dynamo_graph.frontend.models import ModelRegistry


class LocalLoraAdmin:
    """The routes' side (frontend/lora.py LoraRoutes) for an in-process engine."""

    def __init__(self, started: StartedEngine, registry: ModelRegistry) -> None:
        self.started = started
        self.registry = registry
        self.manager = LoraManager(started.engine, started.card, self._publish)

    async def _publish(self, name: str, card: ModelDeploymentCard | None) -> None:
        if card is None:
            self.registry.remove(name)
            return
        model = self.started.model
        assert model is not None  # a tokens-input engine (checked before anything loads)
        self.registry.add(tokens_pipeline(card, model, self.started.backend))

    def _check_tokens(self) -> None:
        if self.started.config.model_input != "tokens":
            name = self.started.card.display_name
            raise InvalidArgument(
                f"`{name}` is served by a text-input engine: LoRA adapters need a tokens-input one",
                param="lora_name",
            )

    async def load_declared(self, lora_modules: str | None) -> None:
        if lora_modules:
            self._check_tokens()
        await self.manager.load_declared(lora_modules)

    async def load(self, request: LoadLoraAdapter) -> str:
        base = self.started.card.display_name
        if request.base_model not in (None, base):
            message = f"The base model `{request.base_model}` does not exist."
            raise HTTPError(404, message, param="base_model", code="model_not_found")
        if request.instance_ids is not None:
            raise HTTPError(400, "instance_ids: this server runs its engine in-process", param="instance_ids")
        self._check_tokens()
        await self.manager.load(request.lora_name, request.lora_path)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload(self, request: UnloadLoraAdapter) -> str:
        await self.manager.unload(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
