"""`out=auto`: keep the frontend's models in step with the workers that discovery knows.

Watches the model deployment cards (`v1/mdc/...`): the first card of a model name builds its
pipeline and a client for its endpoint; later cards of the same model must carry the same
checksum, or that worker is refused (loudly) and never routed to. When the last card of a
model goes (its replicas replaced one by one can leave none for a moment) the model stays for
`--model-wait-s`: listed, its requests waiting for a worker (frontend/openai_asgi.py), answered
503 with Retry-After past the wait; a card that comes back within it serves again (a new card
with another checksum replaces the model), else the model leaves /v1/models. Workers refused
for another checksum take over when the model's last accepted card goes (a rolling update that
changed the card). With `--router-mode kv`, each tokens-input model gets its own KV router,
subscribed to its workers' KV events.

Tokens-input models get request migration around their router (router/migration.py): the
frontend's `--migration-limit` when given explicitly, else the limit in the first worker's card.
Text-input models do not migrate (their streams carry text, not the tokens a continuation needs).

Disaggregated models: cards whose model type is `prefill` (workers started with
`--disaggregation-mode prefill`) form the model's prefill pool — its own client and, with kv
routing, its own KV router fed by the prefill workers' events — under the same checksum rule.
Every tokens-input model's router sits inside a `DisaggRouter` (router/disagg.py) that sends
prompts to that pool once it exists; until then requests pass straight through. A prefill pool
may appear before the model's decode workers do: it waits, unserved, until they register. A
prefill worker whose card's runtime_config names a bootstrap server (SGLang) is kept with its
address in the pool's `bootstraps`, which the DisaggRouter pairs requests by.

LoRA adapters: a worker serving an adapter publishes its card (the base card under the
adapter's name, `lora` naming the base model) one key below its own; the adapter becomes a model
of its own, routed only to the workers whose adapter card is accepted. With `--router-mode kv`
it gets its own KV router on the base model's channel: stored events name the adapter their
blocks belong to, and the adapter's router keeps only its adapter's blocks (as the base model's
keeps only the base model's) and hashes prompts with the adapter's seed, so adapter requests
find the adapter's cached prefixes and nothing else (router/kv/protocols.py). Adapters loaded at
run time get the same when their cards appear. frontend/lora.py loads and unloads adapters.

Each model's instances are health-checked (runtime/health.py) with the payload each worker's
card carries (`user_data.health_check_payload`): one that fails a check leaves routing until it
passes one. Refused workers are listed in /health as `refused`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamo_graph.frontend.limits import DEFAULT_MODEL_WAIT_S
from dynamo_graph.frontend.metrics import DISAGG, count_migration
from dynamo_graph.frontend.models import ModelRegistry
from dynamo_graph.frontend.remote import (
    KvRoutedTokensBackend,
    RemoteEmbedder,
    RemoteTextBackend,
    RemoteTokensBackend,
)
from dynamo_graph.frontend.router_metrics import ROUTERS
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.embeddings import EmbeddingPipeline
from dynamo_graph.llm.model_source import ModelResolutionError, resolve_model
from dynamo_graph.llm.pipeline import ModelPipeline, TextPipeline, tokens_pipeline
from dynamo_graph.llm.protocol import PreprocessedRequest
from dynamo_graph.router.config import DisaggConfig, RouterConfig
from dynamo_graph.router.decisions import DecisionLog, PoolDecisions
from dynamo_graph.router.disagg import DisaggRouter, PrefillPool, UncachedTokens, bootstrap_address
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.router.migration import Migration, RoutedBackend
from dynamo_graph.runtime.client import Client
from dynamo_graph.runtime.health import HealthChecker, HealthSettings, default_payload
from dynamo_graph.runtime.names import MDC_ROOT, EndpointName, endpoint_from_key, instance_id_from_key
from dynamo_graph.runtime.runtime import DistributedRuntime, InstanceRecord
from dynamo_graph.runtime.traffic import has_labels, parse_labels

log = logging.getLogger(__name__)
LABELS_WAIT_S = 10.0  # for the instance record of a card, when the frontend routes by labels
LABELS_POLL_S = 0.05


class CardMismatch(ValueError):
    """The frontend's copy of a model differs from the card its worker published."""


@dataclass
class _Model:
    """One pool of a model's workers: its decode (or aggregated) pool, or its prefill pool."""

    checksum: str
    client: Client
    router: KvRouter | None = None
    checker: HealthChecker | None = None
    card_keys: set[str] = field(default_factory=set)
    # The decode pool's disaggregation router (tokens-input models), which a prefill pool joins.
    disagg: DisaggRouter | None = None
    routed: PrefillPool | None = None
    # A prefill pool's instances -> their bootstrap servers (engines that pair by room).
    bootstraps: dict[int, tuple[str, int]] = field(default_factory=dict)
    card: ModelDeploymentCard | None = None  # the first accepted card
    # Its last card went: the task that removes it after --model-wait-s unless one comes back.
    expiry: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
        if self.checker is not None:
            await self.checker.close()
        await self.client.close()
        if self.router is not None:
            ROUTERS.remove(self.router)
            await self.router.close()


def migration_limit_for(card: ModelDeploymentCard, frontend_limit: int | None) -> int:
    """The frontend's limit when it set one, else the card's."""
    return card.migration_limit if frontend_limit is None else frontend_limit


def routed_backend(
    client: Client, router: KvRouter | None, decisions: PoolDecisions | None = None
) -> RoutedBackend:
    if router is None:
        return RemoteTokensBackend(client, decisions)
    return KvRoutedTokensBackend(client, router, decisions)


def build_remote_pipeline(
    card: ModelDeploymentCard,
    client: Client,
    router: KvRouter | None = None,
    *,
    migration_limit: int | None = None,
    disagg: DisaggConfig | None = None,
    decisions: PoolDecisions | None = None,
) -> tuple[ModelPipeline | EmbeddingPipeline, DisaggRouter | None]:
    """The model's pipeline, and for a tokens-input model the disaggregation router inside it.
    `migration_limit`: the frontend's, or None to take the card's. Embedding models are routed
    by the client's picker (no KV cache to aim at) and retried elsewhere when a worker fails."""
    if card.model_input == "text":
        return TextPipeline(card, RemoteTextBackend(client)), None
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
    limit = migration_limit_for(card, migration_limit)
    if "embedding" in card.model_type:
        embedder = RemoteEmbedder(client, limit, model=card.display_name, on_migrate=count_migration)
        return EmbeddingPipeline(card, model.load_tokenizer(), embedder), None
    uncached: UncachedTokens | None = None
    if router is not None:
        kv_router = router

        def uncached(request: PreprocessedRequest, instance_ids: list[int]) -> int:
            prefixes = request.routing.prefixes if request.routing is not None else None
            return kv_router.uncached_tokens(request.token_ids, instance_ids, prefixes, request.cache_salt)

    disagg_router = DisaggRouter(
        routed_backend(client, router, decisions),
        disagg,
        model=card.display_name,
        hooks=DISAGG,
        decode_uncached=uncached,
    )
    backend = Migration(disagg_router, limit, model=card.display_name, on_migrate=count_migration)
    return tokens_pipeline(card, model, backend), disagg_router


class ModelWatcher:
    def __init__(
        self,
        runtime: DistributedRuntime,
        registry: ModelRegistry,
        *,
        router_mode: str = "round-robin",
        kv_config: RouterConfig | None = None,
        only_endpoint: EndpointName | None = None,
        migration_limit: int | None = None,
        health: HealthSettings | None = None,
        disagg: DisaggConfig | None = None,
        model_wait_s: float = DEFAULT_MODEL_WAIT_S,
    ) -> None:
        """`health`: the instances' health checks; None: from the environment
        (DYN_HEALTH_CHECK_INTERVAL_S / DYN_HEALTH_CHECK_TIMEOUT_S, which --health-check-* set).
        `model_wait_s`: how long a model whose last card went stays (--model-wait-s)."""
        self.runtime = runtime
        self.model_wait_s = model_wait_s
        self.health = HealthSettings.from_env() if health is None else health
        self.migration_limit = migration_limit  # None: each model's card says
        self.registry = registry
        self.router_mode = router_mode
        self.kv_config = kv_config
        self.disagg = disagg
        self._prefill: dict[str, _Model] = {}  # model name -> its prefill pool
        self.prefix = f"{MDC_ROOT}/{only_endpoint.path}/" if only_endpoint else f"{MDC_ROOT}/"
        self._models: dict[str, _Model] = {}
        self._model_of_key: dict[str, tuple[str, bool]] = {}  # card key -> (model, prefill pool?)
        self._refused: dict[str, tuple[str, bool, bytes]] = {}  # card key -> (model, prefill?, card)
        labels = kv_config.instance_labels if kv_config is not None else None
        self.labels = parse_labels(labels, "--router-instance-labels") if labels else {}
        self.decisions = DecisionLog.open(kv_config)
        self._handled: set[str] = set()  # card keys whose latest event was taken in (`settled`)
        self._took_one = asyncio.Event()

    async def run(self) -> None:
        discovery = self.runtime.discovery
        assert discovery is not None, "model discovery needs a discovery backend"
        async for event in discovery.watch_prefix(self.prefix):
            if event.kind == "put" and event.value is not None:
                await self._added(event.key, event.value)
            else:
                await self._removed(event.key)
            self._handled.add(event.key)
            self._took_one.set()

    async def settled(self, timeout_s: float) -> None:
        """Until the cards in discovery now have been taken in (their models built, or refused),
        at most `timeout_s`. A frontend joins its port only then: beside other frontends already
        serving there (its replicas, or the run a rollout replaces), it would otherwise answer
        404 for their models while it builds them."""
        discovery = self.runtime.discovery
        assert discovery is not None, "model discovery needs a discovery backend"
        keys = set(await discovery.get_prefix(self.prefix))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not keys <= self._handled:
                    self._took_one.clear()
                    await self._took_one.wait()

    async def _added(self, key: str, value: bytes) -> None:
        try:
            card = ModelDeploymentCard.from_json(value)
            endpoint = endpoint_from_key(key)
            instance_id = instance_id_from_key(key)
        except (msgspec.DecodeError, ValueError) as err:
            log.warning("ignoring malformed model card %s: %s", key, err)
            return
        if self.labels and not await self._labelled(endpoint, instance_id):
            log.info("ignoring worker %x: not labelled %s", instance_id, self.labels)
            return
        name = card.display_name
        prefill = "prefill" in card.model_type
        pools = self._prefill if prefill else self._models
        model = pools.get(name)
        replaced: _Model | None = None
        if model is not None and model.expiry is not None and card.mdcsum() != model.checksum:
            # Its workers are gone and one came with another card: that card's model replaces
            # it, listed all the while, so its requests wait rather than get 404.
            replaced, model = pools.pop(name), None
        if model is None:
            if prefill:
                model = await self._new_prefill_pool(card, endpoint, instance_id)
            else:
                model = await self._new_model(card, endpoint, instance_id)
            if replaced is not None:
                await replaced.close()
                log.info("model %r: replaced by workers with model card %s", name, card.mdcsum())
                if model is None:
                    self.registry.remove(name)
            if model is None:
                return
            pools[name] = model
        elif card.mdcsum() != model.checksum:
            log.error(
                "REFUSING %sworker %x for model %r: its model card checksum %s differs from %s "
                "(different files, template, context length or block size)",
                "prefill " if prefill else "",
                instance_id,
                name,
                card.mdcsum(),
                model.checksum,
            )
            model.client.refused[instance_id] = (
                time.time(),
                f"model card checksum {card.mdcsum()} differs from the model's {model.checksum}",
            )
            self._refused[key] = (name, prefill, value)
            return
        if model.expiry is not None:
            model.expiry.cancel()
            model.expiry = None
            log.info("model %r: a worker is back", name)
        model.card_keys.add(key)
        self._model_of_key[key] = (name, prefill)
        if model.router is not None:
            model.router.add_worker(instance_id, card.runtime_config)
        address = bootstrap_address(card.runtime_config) if prefill else None
        if address is not None:
            model.bootstraps[instance_id] = address
        if model.checker is not None:
            model.checker.payloads[instance_id] = _health_payload(card)
        assert model.client.allowed is not None
        model.client.allowed.add(instance_id)

    def _client_and_router(
        self, card: ModelDeploymentCard, endpoint: EndpointName, kv: bool
    ) -> tuple[Client, KvRouter | None]:
        """A pool's client (routing to the instances whose cards are accepted) and KV router."""
        # The client's own picker: round-robin under a KV router, and for the models a KV router
        # cannot route (text input, embeddings) when the frontend's mode is kv.
        mode = "round-robin" if self.router_mode == "kv" else self.router_mode
        client = Client(self.runtime, endpoint, router_mode=mode)
        client.allowed = set()
        if not kv:
            return client, None
        router = KvRouter(
            card.kv_cache_block_size, self.kv_config, lora_name=card.display_name if card.lora else None
        )
        ROUTERS.add(card.display_name, "prefill" if "prefill" in card.model_type else "decode", router)
        return client, router

    async def _started_pool(
        self, card: ModelDeploymentCard, endpoint: EndpointName, client: Client, router: KvRouter | None
    ) -> _Model:
        """The pool, its client watching discovery, its router hearing the pool's KV events."""
        await client.start()
        if router is not None:
            await router.subscribe(self.runtime, endpoint.namespace, endpoint.component)
        return _Model(
            checksum=card.mdcsum(),
            client=client,
            router=router,
            checker=self._start_checker(client, card),
            card=card,
        )

    def _start_checker(self, client: Client, card: ModelDeploymentCard) -> HealthChecker | None:
        if not self.health.enabled:
            return None
        fallback = default_payload(card.display_name, card.model_input, card.bos_token_id)
        checker = HealthChecker(client, self.health, fallback)
        checker.start()
        return checker

    async def _new_model(
        self, card: ModelDeploymentCard, endpoint: EndpointName, instance_id: int
    ) -> _Model | None:
        """The model's decode (or aggregated) pool and its pipeline, listed in /v1/models."""
        name = card.display_name
        kv = self.router_mode == "kv" and card.model_input == "tokens" and "embedding" not in card.model_type
        client, router = self._client_and_router(card, endpoint, kv)
        try:
            pipeline, disagg = build_remote_pipeline(
                card,
                client,
                router,
                migration_limit=self.migration_limit,
                disagg=self.disagg,
                decisions=self._pool_decisions(name, False, router),
            )
        except (ModelResolutionError, CardMismatch, OSError) as err:
            log.error("cannot serve model %r from worker %x: %s", name, instance_id, err)
            return None
        if self.router_mode == "kv" and not kv:
            why = "serves embeddings" if "embedding" in card.model_type else "takes text, not tokens"
            log.warning("model %r %s: no kv routing for it; round-robin", name, why)
        model = await self._started_pool(card, endpoint, client, router)
        model.disagg = disagg
        prefill = self._prefill.get(name)
        if disagg is not None and prefill is not None:
            disagg.prefill, disagg.bootstraps = prefill.routed, prefill.bootstraps
        self.registry.add(
            pipeline,
            instances=lambda: self._health_report(name, client),
            routable=lambda: bool(client.instance_ids()),
        )
        log.info(
            "model %r added (endpoint %s, %s routing, migration limit %s%s)",
            name,
            endpoint,
            self.router_mode,
            migration_limit_for(card, self.migration_limit) if card.model_input == "tokens" else "n/a",
            ", prefill workers up" if prefill is not None else "",
        )
        return model

    def _health_report(self, name: str, client: Client) -> dict[str, Any]:
        """/health for one model: its decode pool, and its prefill pool when it has one."""
        report = client.health_report()
        pool = self._prefill.get(name)
        if pool is not None:
            report["prefill_instances"] = pool.client.report()
            report["prefill_unavailable"] = pool.client.unavailable()
        return report

    async def _new_prefill_pool(
        self, card: ModelDeploymentCard, endpoint: EndpointName, instance_id: int
    ) -> _Model | None:
        """The model's prefill pool, joined to its decode pool's disaggregation router (now, or
        when the decode pool appears)."""
        name = card.display_name
        main = self._models.get(name)
        if main is not None and card.mdcsum() != main.checksum:
            log.error(
                "REFUSING prefill worker %x for model %r: its card checksum %s differs from the "
                "decode workers' %s",
                instance_id,
                name,
                card.mdcsum(),
                main.checksum,
            )
            return None
        if card.model_input != "tokens":
            log.error(
                "REFUSING prefill worker %x for model %r: prefill workers take tokens", instance_id, name
            )
            return None
        client, router = self._client_and_router(card, endpoint, self.router_mode == "kv")
        pool = await self._started_pool(card, endpoint, client, router)
        pool.routed = routed_backend(client, router, self._pool_decisions(name, True, router))
        if main is not None and main.disagg is not None:
            main.disagg.prefill, main.disagg.bootstraps = pool.routed, pool.bootstraps
        log.info("model %r: prefill pool added (endpoint %s, %s routing)", name, endpoint, self.router_mode)
        return pool

    def _pool_decisions(self, name: str, prefill: bool, router: KvRouter | None) -> PoolDecisions | None:
        if self.decisions is None:
            return None
        return self.decisions.pool(name, prefill, kv=router is not None)

    async def _labelled(self, endpoint: EndpointName, instance_id: int) -> bool:
        """Whether the instance carries the labels this frontend routes to. A worker publishes
        its card just before its instance record: wait for that a little."""
        discovery = self.runtime.discovery
        assert discovery is not None
        key = endpoint.instance_key(instance_id)
        deadline = time.monotonic() + LABELS_WAIT_S
        while True:
            found = await discovery.get_prefix(key)
            if key in found:
                try:
                    record = msgspec.json.decode(found[key], type=InstanceRecord)
                except msgspec.DecodeError:
                    return False
                return has_labels(record.labels, self.labels)
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(LABELS_POLL_S)

    async def _removed(self, key: str) -> None:
        refused = self._refused.pop(key, None)
        if refused is not None:
            pool = (self._prefill if refused[1] else self._models).get(refused[0])
            if pool is not None:
                pool.client.refused.pop(instance_id_from_key(key), None)
        found = self._model_of_key.pop(key, None)
        if found is None:
            return
        name, prefill = found
        model = (self._prefill if prefill else self._models)[name]
        instance_id = instance_id_from_key(key)
        model.card_keys.discard(key)
        assert model.client.allowed is not None
        model.client.allowed.discard(instance_id)
        if model.checker is not None:
            model.checker.forget(instance_id)
        if model.router is not None:
            model.router.remove_worker(instance_id)
        model.bootstraps.pop(instance_id, None)
        if prefill or model.card_keys:
            # A prefill pool stays when empty: its router then counts the local prefills.
            return
        waiting = {k: v for k, (n, p, v) in self._refused.items() if n == name and not p}
        if self.model_wait_s <= 0 and not waiting:
            await self._drop(name, "no workers left")
            return
        model.expiry = asyncio.create_task(self._expire(name, model), name=f"expire model {name}")
        log.info("model %r: no workers left; waiting %gs for one", name, self.model_wait_s)
        # Workers refused for another card (a rolling update that changed it) take over now.
        for other, value in waiting.items():
            del self._refused[other]
            await self._added(other, value)

    async def _expire(self, name: str, model: _Model) -> None:
        await asyncio.sleep(self.model_wait_s)
        model.expiry = None  # done: closing the model must not cancel this task
        if self._models.get(name) is model and not model.card_keys:
            await self._drop(name, f"no worker came back within {self.model_wait_s:g}s")

    async def _drop(self, name: str, why: str) -> None:
        """The model leaves /v1/models; its requests are 404 again."""
        model = self._models.pop(name)
        self.registry.remove(name)
        await model.close()
        log.info("model %r removed: %s", name, why)

    async def forget(self, name: str) -> None:
        """Drop a model that has no workers now, without waiting for them to come back (an
        adapter unloaded on purpose, frontend/lora.py)."""
        model = self._models.get(name)
        if model is not None and not model.card_keys:
            await self._drop(name, "unloaded")

    def serving(self, name: str) -> tuple[EndpointName, list[int], ModelDeploymentCard] | None:
        """A served model's endpoint, the instances whose cards were accepted, and its card; None
        while it waits for its workers to come back."""
        model = self._models.get(name)
        if model is None or model.card is None or not model.card_keys:
            return None
        return model.client.name, sorted(model.client.allowed or ()), model.card

    def routable(self, name: str) -> set[int]:
        """The instances requests for `name` may go to now (none once it is gone)."""
        model = self._models.get(name)
        return set() if model is None else set(model.client.instance_ids())

    async def close(self) -> None:
        for model in [*self._models.values(), *self._prefill.values()]:
            await model.close()
        self._models.clear()
        self._prefill.clear()
        if self.decisions is not None:
            self.decisions.close()


def _health_payload(card: ModelDeploymentCard) -> dict[str, Any]:
    """The worker's own health-check request from its card, else the tiniest generate."""
    payload = (card.user_data or {}).get("health_check_payload")
    if isinstance(payload, dict):
        return payload
    return default_payload(card.display_name, card.model_input, card.bos_token_id)
