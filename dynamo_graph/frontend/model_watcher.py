"""`out=auto`: keep the frontend's models in step with the workers that discovery knows.

Watches the model deployment cards (`v1/mdc/...`): the first card of a model name builds its
pipeline and a client for its endpoint; later cards of the same model must carry the same
checksum, or that worker is refused (loudly) and never routed to; when the last card of a
model goes, the model leaves /v1/models. With `--router-mode kv`, each tokens-input model gets
its own KV router, subscribed to its workers' KV events.

Tokens-input models get request migration around their router (router/migration.py): the
frontend's `--migration-limit` when given explicitly, else the limit in the first worker's card.
Text-input models do not migrate (their streams carry text, not the tokens a continuation needs).

Each model's instances are health-checked (runtime/health.py) with the payload each worker's
card carries (`user_data.health_check_payload`): one that fails a check leaves routing until it
passes one. Refused workers are listed in /health as `refused`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamo_graph.frontend.metrics import count_migration
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.remote import KvRoutedTokensBackend, RemoteTextBackend, RemoteTokensBackend
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.model_source import ModelResolutionError, resolve_model
from dynamo_graph.llm.pipeline import ModelPipeline, TextPipeline, tokens_pipeline
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.router.kv.scheduler import KvRouterConfig
from dynamo_graph.router.migration import Migration
from dynamo_graph.runtime.client import Client
from dynamo_graph.runtime.health import HealthChecker, HealthSettings, default_payload
from dynamo_graph.runtime.names import MDC_ROOT, EndpointName, endpoint_from_key, instance_id_from_key
from dynamo_graph.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)


class CardMismatch(ValueError):
    pass


@dataclass
class _Model:
    checksum: str
    client: Client
    router: KvRouter | None = None
    checker: HealthChecker | None = None
    card_keys: set[str] = field(default_factory=set)


def migration_limit_for(card: ModelDeploymentCard, frontend_limit: int | None) -> int:
    """The frontend's limit when it set one, else the card's."""
    return card.migration_limit if frontend_limit is None else frontend_limit


def build_remote_pipeline(
    card: ModelDeploymentCard,
    client: Client,
    router: KvRouter | None = None,
    *,
    migration_limit: int | None = None,
) -> ModelPipeline:
    """`migration_limit`: the frontend's, or None to take the card's."""
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
    routed = RemoteTokensBackend(client) if router is None else KvRoutedTokensBackend(client, router)
    limit = migration_limit_for(card, migration_limit)
    backend = Migration(routed, limit, model=card.display_name, on_migrate=count_migration)
    return tokens_pipeline(card, model, backend)


class ModelWatcher:
    def __init__(
        self,
        runtime: DistributedRuntime,
        registry: ModelRegistry,
        *,
        router_mode: str = "round-robin",
        kv_config: KvRouterConfig | None = None,
        only_endpoint: EndpointName | None = None,
        migration_limit: int | None = None,
        health: HealthSettings | None = None,
    ) -> None:
        """`health`: the instances' health checks; None: from the environment
        (DYN_HEALTH_CHECK_INTERVAL_S / DYN_HEALTH_CHECK_TIMEOUT_S, which --health-check-* set)."""
        self.runtime = runtime
        self.health = HealthSettings.from_env() if health is None else health
        self.migration_limit = migration_limit  # None: each model's card says
        self.registry = registry
        self.router_mode = router_mode
        self.kv_config = kv_config
        self.prefix = f"{MDC_ROOT}/{only_endpoint.path}/" if only_endpoint else f"{MDC_ROOT}/"
        self._models: dict[str, _Model] = {}
        self._model_of_key: dict[str, str] = {}
        self._refused: dict[str, str] = {}  # card key -> model name

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
            kv = self.router_mode == "kv" and card.model_input == "tokens"
            client = Client(self.runtime, endpoint, router_mode="round-robin" if kv else self.router_mode)
            client.allowed = set()
            router = KvRouter(card.kv_cache_block_size, self.kv_config) if kv else None
            try:
                pipeline = build_remote_pipeline(card, client, router, migration_limit=self.migration_limit)
            except (ModelResolutionError, CardMismatch, OSError) as err:
                log.error("cannot serve model %r from worker %x: %s", name, instance_id, err)
                return
            if self.router_mode == "kv" and not kv:
                log.warning("model %r takes text, not tokens: kv routing needs tokens; round-robin", name)
            await client.start()
            if router is not None:
                await router.subscribe(self.runtime, endpoint.namespace, endpoint.component)
            checker = None
            if self.health.enabled:
                fallback = default_payload(name, card.model_input, card.bos_token_id)
                checker = HealthChecker(client, self.health, fallback)
                checker.start()
            model = self._models[name] = _Model(
                checksum=card.mdcsum(), client=client, router=router, checker=checker
            )
            self.registry.add(pipeline, instances=client.health_report)
            log.info(
                "model %r added (endpoint %s, %s routing, migration limit %s)",
                name,
                endpoint,
                self.router_mode,
                migration_limit_for(card, self.migration_limit) if card.model_input == "tokens" else "n/a",
            )
        elif card.mdcsum() != model.checksum:
            log.error(
                "REFUSING worker %x for model %r: its model card checksum %s differs from %s "
                "(different files, template, context length or block size)",
                instance_id,
                name,
                card.mdcsum(),
                model.checksum,
            )
            model.client.refused[instance_id] = (
                time.time(),
                f"model card checksum {card.mdcsum()} differs from the model's {model.checksum}",
            )
            self._refused[key] = name
            return
        model.card_keys.add(key)
        self._model_of_key[key] = name
        if model.router is not None:
            model.router.dp_sizes[instance_id] = int((card.runtime_config or {}).get("data_parallel_size", 1))
        if model.checker is not None:
            model.checker.payloads[instance_id] = _health_payload(card)
        assert model.client.allowed is not None
        model.client.allowed.add(instance_id)

    async def _removed(self, key: str) -> None:
        refused = self._refused.pop(key, None)
        if refused is not None and refused in self._models:
            self._models[refused].client.refused.pop(instance_id_from_key(key), None)
        name = self._model_of_key.pop(key, None)
        if name is None:
            return
        model = self._models[name]
        model.card_keys.discard(key)
        assert model.client.allowed is not None
        model.client.allowed.discard(instance_id_from_key(key))
        if model.checker is not None:
            model.checker.forget(instance_id_from_key(key))
        if model.router is not None:
            model.router.remove_worker(instance_id_from_key(key))
        if not model.card_keys:
            del self._models[name]
            self.registry.remove(name)
            if model.checker is not None:
                await model.checker.close()
            await model.client.close()
            if model.router is not None:
                await model.router.close()
            log.info("model %r removed: no workers left", name)

    async def close(self) -> None:
        for model in self._models.values():
            if model.checker is not None:
                await model.checker.close()
            await model.client.close()
            if model.router is not None:
                await model.router.close()
        self._models.clear()


def _health_payload(card: ModelDeploymentCard) -> dict[str, Any]:
    """The worker's own health-check request from its card, else the tiniest generate."""
    payload = (card.user_data or {}).get("health_check_payload")
    if isinstance(payload, dict):
        return payload
    return default_payload(card.display_name, card.model_input, card.bos_token_id)
