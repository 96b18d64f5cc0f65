"""`out=auto`: keep the frontend's models in step with the workers that discovery knows.

Watches the model deployment cards (`v1/mdc/...`): the first card of a model name builds its
pipeline and a client for its endpoint; later cards of the same model must carry the same
checksum, or that worker is refused (loudly) and never routed to; when the last card of a
model goes, the model leaves /v1/models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec

from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.remote import RemoteTextBackend, RemoteTokensBackend
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.model_source import ModelResolutionError, resolve_model
from dynamo_graph.llm.pipeline import ModelPipeline, TextPipeline, tokens_pipeline
from dynamo_graph.runtime.client import Client
from dynamo_graph.runtime.names import MDC_ROOT, EndpointName, endpoint_from_key, instance_id_from_key
from dynamo_graph.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)


class CardMismatch(ValueError):
    pass


@dataclass
class _Model:
    checksum: str
    client: Client
    card_keys: set[str] = field(default_factory=set)


def build_remote_pipeline(card: ModelDeploymentCard, client: Client) -> ModelPipeline:
    if card.model_input == "text":
        return TextPipeline(card, RemoteTextBackend(client))
    # The frontend tokenizes: it needs the model's tokenizer files, from the same path (one host,
    # or a shared disk) or the Hugging Face cache, and they must be the worker's exact files.
    model = resolve_model(card.source_path, model_name=card.display_name)
    local = ModelDeploymentCard.from_local_model(
        model, context_length=card.context_length, kv_cache_block_size=card.kv_cache_block_size
    )
    for name in ("tokenizer", "tokenizer_config"):
        theirs, ours = card.files.get(name), local.files.get(name)
        if theirs is not None and ours is not None and theirs.checksum != ours.checksum:
            raise CardMismatch(f"{name} at {ours.path} differs from the worker's ({theirs.checksum})")
    return tokens_pipeline(card, model, RemoteTokensBackend(client))


class ModelWatcher:
    def __init__(
        self,
        runtime: DistributedRuntime,
        registry: ModelRegistry,
        *,
        router_mode: str = "round-robin",
        only_endpoint: EndpointName | None = None,
    ) -> None:
        self.runtime = runtime
        self.registry = registry
        self.router_mode = router_mode
        self.prefix = f"{MDC_ROOT}/{only_endpoint.path}/" if only_endpoint else f"{MDC_ROOT}/"
        self._models: dict[str, _Model] = {}
        self._model_of_key: dict[str, str] = {}

    async def run(self) -> None:
        discovery = self.runtime.discovery
        assert discovery is not None, "model discovery needs a discovery backend"
        async for event in discovery.watch_prefix(self.prefix):
            if event.kind == "put" and event.value is not None:
                await self._added(event.key, event.value)
            else:
                await self._removed(event.key)

    async def _added(self, key: str, value: bytes) -> None:
        try:
            card = ModelDeploymentCard.from_json(value)
            endpoint = endpoint_from_key(key)
            instance_id = instance_id_from_key(key)
        except (msgspec.DecodeError, ValueError) as err:
            log.warning("ignoring malformed model card %s: %s", key, err)
            return
        name = card.display_name
        model = self._models.get(name)
        if model is None:
            client = Client(self.runtime, endpoint, router_mode=self.router_mode)
            client.allowed = set()
            try:
                pipeline = build_remote_pipeline(card, client)
            except (ModelResolutionError, CardMismatch, OSError) as err:
                log.error("cannot serve model %r from worker %x: %s", name, instance_id, err)
                return
            await client.start()
            model = self._models[name] = _Model(checksum=card.mdcsum(), client=client)
            self.registry.add(pipeline, instances=client.report)
            log.info("model %r added (endpoint %s)", name, endpoint)
        elif card.mdcsum() != model.checksum:
            log.error(
                "REFUSING worker %x for model %r: its model card checksum %s differs from %s "
                "(different files, template, context length or block size)",
                instance_id,
                name,
                card.mdcsum(),
                model.checksum,
            )
            return
        model.card_keys.add(key)
        self._model_of_key[key] = name
        assert model.client.allowed is not None
        model.client.allowed.add(instance_id)

    async def _removed(self, key: str) -> None:
        name = self._model_of_key.pop(key, None)
        if name is None:
            return
        model = self._models[name]
        model.card_keys.discard(key)
        assert model.client.allowed is not None
        model.client.allowed.discard(instance_id_from_key(key))
        if not model.card_keys:
            del self._models[name]
            self.registry.remove(name)
            await model.client.close()
            log.info("model %r removed: no workers left", name)

    async def close(self) -> None:
        for model in self._models.values():
            await model.client.close()
        self._models.clear()
