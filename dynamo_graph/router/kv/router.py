"""One model's KV-aware router in a frontend: where each request should go, and why.

Ties together the indexer of the workers' caches (fed by KV events from the event plane, or,
with `use_kv_events=False`, the approximate indexer fed by the router's own decisions), the
bookkeeping of in-flight requests, the cost (predict.py's predicted TTFT by default, or Dynamo's,
cost.py), session affinity (affinity.py) and the queue in front of saturated workers
(queue.py). The caller admits (when queueing is on), routes, then reports the first token and
the end of every request it routed. The workers' load metrics (reported.py) add what other
frontends sent to the same workers.

A LoRA adapter served as a model of its own gets a router of its own (`lora_name`): its index
keeps only the adapter's stored blocks from the shared channel, and it hashes prompts with the
adapter's seed (hashing.py), so its hits are the adapter's cached prefixes and never the base
model's or another adapter's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.options import check_values
from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.affinity import AffinityMode, SessionAffinity
from dynamo_graph.router.kv.approx import ApproxKvIndexer
from dynamo_graph.router.kv.cost import Choice, score_workers, select
from dynamo_graph.router.kv.hashing import lora_hash_seed
from dynamo_graph.router.kv.indexer import KvIndexer
from dynamo_graph.router.kv.predict import TtftModel, pick_near_best, predict_workers
from dynamo_graph.router.kv.prefix_hashes import PrefixHashCache
from dynamo_graph.router.kv.protocols import (
    KV_EVENTS_TOPIC,
    LOAD_METRICS_TOPIC,
    decode_kv_event,
    decode_load_metrics,
)
from dynamo_graph.router.kv.queue import DEFAULT_MAX_BATCHED_TOKENS, QueuePolicy, RouterQueue
from dynamo_graph.router.kv.sequences import ActiveSequences, WorkerKey

if TYPE_CHECKING:
    from dynamo_graph.runtime.context import Context
    from dynamo_graph.runtime.events.base import EventSubscriber
    from dynamo_graph.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)


class NoWorkers(LookupError):
    """The router has no worker instance to place a request on."""


class KvRouter:
    def __init__(
        self,
        block_size: int,
        config: RouterConfig | None = None,
        *,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """`lora_name`: the LoRA adapter this router routes (None: the base model)."""
        if block_size <= 0:
            raise ValueError(f"kv routing needs a positive kv cache block size, not {block_size}")
        self.block_size = block_size
        self.config = config or RouterConfig()
        check_values(self.config, str)  # a router configured in code is held to the same bounds
        self.lora_name = lora_name
        self.indexer: KvIndexer | ApproxKvIndexer
        if self.config.use_kv_events:
            self.indexer = KvIndexer(lora_name=lora_name)
        else:
            self.indexer = ApproxKvIndexer(
                ttl_s=self.config.ttl_s,
                max_tree_size=self.config.max_tree_size,
                prune_target_ratio=self.config.prune_target_ratio,
            )
        self.sequences = ActiveSequences()
        self.prefix_hashes = PrefixHashCache(block_size, seed=lora_hash_seed(lora_name))
        self.model = TtftModel()
        config = self.config
        self.affinity: SessionAffinity | None = None
        if config.session_affinity_ttl_secs > 0:
            mode: AffinityMode = config.session_affinity_mode  # type: ignore[assignment]
            self.affinity = SessionAffinity(config.session_affinity_ttl_secs, mode)
        self.queue: RouterQueue | None = None
        if config.queue_threshold is not None:
            policy: QueuePolicy = config.queue_policy  # type: ignore[assignment]
            self.queue = RouterQueue(
                self.free_ranks, policy=policy, max_size=config.max_queue_size, reserve=config.queue_reserve
            )
        self._candidates: list[WorkerKey] = []
        # Per worker instance, from its model card: data-parallel ranks (1 when not told),
        # max_num_batched_tokens (the queue threshold's unit) and KV cache blocks per rank.
        self.dp_sizes: dict[int, int] = {}
        self.max_batched_tokens: dict[int, int] = {}
        self.kv_blocks: dict[int, int] = {}  # per rank, from the card's total_kv_blocks
        self.routed = 0
        self.overlap_blocks_routed = 0
        self.events_applied = 0
        self._rng = random.Random(seed)
        self._subscriber: EventSubscriber | None = None
        self._consumer: asyncio.Task[None] | None = None

    def add_worker(self, worker_id: int, runtime_config: Mapping[str, Any] | None) -> None:
        """A worker's model card was accepted: its ranks and batch size, from the card's
        runtime_config."""
        config = runtime_config or {}
        self.dp_sizes[worker_id] = int(config.get("data_parallel_size") or 1)
        batched = config.get("max_num_batched_tokens")
        if batched:
            self.max_batched_tokens[worker_id] = int(batched)
        else:
            self.max_batched_tokens.pop(worker_id, None)
        total = config.get("total_kv_blocks")
        if total:
            self.kv_blocks[worker_id] = int(total) // self.dp_sizes[worker_id]
        else:
            self.kv_blocks.pop(worker_id, None)

    def spare_blocks(self, key: WorkerKey) -> int | None:
        """Cache blocks of a rank its indexed blocks leave free (None: its capacity is unknown)."""
        capacity = self.kv_blocks.get(key[0])
        return None if capacity is None else capacity - self.indexer.tree_size(key)

    async def subscribe(self, runtime: DistributedRuntime, namespace: str, component: str) -> None:
        """Feed the indexer from the KV events of the workers on channel namespace/component
        (unless without KV events, or when overlap does not count: weight 0), and the
        predictive cost and the queue from their load metrics."""
        topics = []
        if self.config.use_kv_events and self.config.kv_overlap_score_weight != 0:
            topics.append(KV_EVENTS_TOPIC)
        if self.config.cost == "predictive" or self.queue is not None:
            topics.append(LOAD_METRICS_TOPIC)
        if not topics:
            return
        from dynamo_graph.runtime.events import create_event_subscriber

        self._subscriber = await create_event_subscriber(
            discovery=runtime.discovery, namespace=namespace, component=component, topics=topics
        )
        self._consumer = asyncio.create_task(self._consume(self._subscriber), name=f"kv events {component}")

    async def _consume(self, subscriber: EventSubscriber) -> None:
        indexer = self.indexer
        reported = self.model.reported
        async for event in subscriber.events():
            try:
                if event.topic == LOAD_METRICS_TOPIC:
                    reported.update(decode_load_metrics(event.payload))
                    if self.queue is not None:
                        self.queue.pump()  # a rank's load may have dropped below the threshold
                    continue
                assert isinstance(indexer, KvIndexer)
                indexer.apply_event(decode_kv_event(event.payload))
            except msgspec.DecodeError as err:
                log.warning("ignoring a malformed %s event from %x: %s", event.topic, event.publisher_id, err)
                continue
            self.events_applied += 1

    def targets(self, instance_ids: Iterable[int]) -> list[WorkerKey]:
        dp_sizes = self.dp_sizes
        return [(i, rank) for i in instance_ids for rank in range(dp_sizes.get(i, 1))]

    def prefill_tokens(self, key: WorkerKey) -> int:
        """Prompt tokens queued on a rank: booked by this router or reported by the rank."""
        return self.model.queued_tokens(key, self.sequences.prefill_tokens(key))

    def busy_limit(self, key: WorkerKey) -> float:
        """Prefill tokens past which the rank is busy: the queue threshold (a fraction) of its
        max_num_batched_tokens, as in Dynamo."""
        fraction = self.config.queue_threshold or 0.0
        return fraction * self.max_batched_tokens.get(key[0], DEFAULT_MAX_BATCHED_TOKENS)

    def free_ranks(self, instance_ids: Iterable[int] | None = None) -> float:
        """How many ranks of these instances (default: the candidates of the last routing) are
        not busy (`busy_limit`), as the queue counts them: with no candidates, or no queue
        threshold, nothing is worth waiting for (infinite; routing says what is wrong)."""
        candidates = self._candidates if instance_ids is None else self.targets(instance_ids)
        if self.config.queue_threshold is None or not candidates:
            return math.inf
        return sum(1 for key in candidates if self.prefill_tokens(key) <= self.busy_limit(key))

    async def admit(
        self,
        priority: int,
        context: Context,
        instance_ids: Iterable[int],
        token_ids: Sequence[int] = (),
        prefixes: Sequence[tuple[int, bytes]] | None = None,
        salt: str | None = None,
    ) -> bool:
        """Wait for a turn while every worker is saturated (no queue: at once); False if the
        request was stopped meanwhile. Raises `QueueFull` past the queue's bound. An admitted
        request must be `dispatched` once routed (or once routing it failed). `token_ids` and
        `prefixes` and `salt` (as for `route`) give the `wspt` order its uncached tokens."""
        if self.queue is None:
            return True
        instances = list(instance_ids)
        self._candidates = self.targets(instances)

        def uncached() -> int:
            return self.uncached_tokens(token_ids, instances, prefixes, salt)

        return await self.queue.admit(priority, context, uncached)

    def dispatched(self) -> None:
        """An admitted request is booked on a worker, or failed to be: the next may go."""
        if self.queue is not None:
            self.queue.routed()

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        instance_ids: Iterable[int],
        *,
        session_id: str | None = None,
        prefixes: Sequence[tuple[int, bytes]] | None = None,
        explain: list[dict[str, Any]] | None = None,
        salt: str | None = None,
    ) -> Choice:
        """Pick a worker rank for the request and book it there. `prefixes`: the prompt's
        leading prefixes named by the segment tokenizer, whose block hashes may be reused.
        `explain`: a list to append every candidate's cost terms to (the decision log).
        `salt`: the request's cache salt (its blocks match only blocks of the same salt)."""
        candidates = self._candidates = self.targets(instance_ids)
        if not candidates:
            raise NoWorkers("no worker instances to route to")
        block_size = self.block_size
        config = self.config
        weight = config.kv_overlap_score_weight
        local, seq = self.prefix_hashes.hashes(token_ids, prefixes, salt)
        overlaps = self.indexer.find_matches(local, seq) if weight and local else {}
        isl = len(token_ids)
        predictive = config.cost == "predictive"
        if predictive:
            choices = predict_workers(
                candidates,
                seq,
                isl,
                block_size,
                overlaps,
                self.sequences,
                self.model,
                config.prefill_penalty,
                self.spare_blocks,
            )
        else:
            choices = score_workers(candidates, seq, isl, block_size, overlaps, self.sequences, weight)
        choice = None
        affinity = self.affinity
        if affinity is not None and session_id:
            choice = affinity.pick(session_id, choices)
        if choice is None:
            if predictive and config.temperature <= 0:
                choice = pick_near_best(choices, self._rng, self.indexer.tree_size)
            else:
                choice = select(choices, config.temperature, self._rng, self.indexer.tree_size)
        if affinity is not None and session_id:
            affinity.bind(session_id, choice.key)
        if explain is not None:
            explain += self._terms(choices, predictive)
        key = choice.key
        if predictive:
            load = self.sequences.loads.get(key)
            queued = self.model.queued_tokens(key, load.prefill_tokens if load is not None else 0)
            blocks = self.model.decode_blocks(key, len(load.blocks) if load is not None else 0)
            self.model.started(request_id, key, queued + choice.prefill_tokens, blocks)
        blocks_booked: list[int] = seq
        if isl % block_size:
            blocks_booked = [*seq, self._rng.getrandbits(64)]  # the partial last block is the request's own
        # The longest named prefix's blocks are what other requests share: booked as one chain.
        shared = prefixes[-1][0] // block_size if prefixes else 0
        self.sequences.add(request_id, key, blocks_booked, choice.prefill_tokens, shared)
        if isinstance(self.indexer, ApproxKvIndexer) and local:
            self.indexer.record_routing(key, local, seq)
        self.routed += 1
        self.overlap_blocks_routed += choice.overlap_blocks
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s -> %x rank %d (overlap %d of %d blocks, cost %.4g; cost/overlap %s)",
                request_id,
                *key,
                choice.overlap_blocks,
                len(local),
                choice.logit,
                ", ".join(f"{c.key[0]:x}.{c.key[1]}={c.logit:.4g}/{c.overlap_blocks}" for c in choices),
            )
        return choice

    def _terms(self, choices: Sequence[Choice], predictive: bool) -> list[dict[str, Any]]:
        """Each candidate's cost terms as the cost saw them (before the request is booked):
        cached-prefix overlap, tokens it would compute, prompt tokens queued there, KV blocks
        its running requests hold, and the cost (predictive: seconds; dynamo: blocks)."""
        loads = self.sequences.loads
        model = self.model
        terms = []
        for c in choices:
            load = loads.get(c.key)
            queued = load.prefill_tokens if load is not None else 0
            held = len(load.blocks) if load is not None else 0
            if predictive:
                queued, held = model.queued_tokens(c.key, queued), model.decode_blocks(c.key, held)
            terms.append(
                {
                    "worker": f"{c.key[0]:x}",
                    "dp_rank": c.key[1],
                    "overlap_blocks": c.overlap_blocks,
                    "new_tokens": c.prefill_tokens,
                    "queued_tokens": queued,
                    "decode_blocks": held,
                    "cost": round(c.logit, 6),
                }
            )
        return terms

    def uncached_tokens(
        self,
        token_ids: Sequence[int],
        instance_ids: Iterable[int],
        prefixes: Sequence[tuple[int, bytes]] | None = None,
        salt: str | None = None,
    ) -> int:
        """Prompt tokens the best-placed of these workers would still have to compute.
        `prefixes` and `salt`: as for `route`."""
        local, seq = self.prefix_hashes.hashes(token_ids, prefixes, salt)
        if not local:
            return len(token_ids)
        overlaps = self.indexer.find_matches(local, seq)
        best = max((overlaps.get(key, 0) for key in self.targets(instance_ids)), default=0)
        return len(token_ids) - best * self.block_size

    def prefill_completed(self, request_id: str) -> None:
        self.sequences.prefill_completed(request_id)
        self.model.first_token(request_id)
        if self.queue is not None:
            self.queue.pump()

    def free(self, request_id: str) -> None:
        self.sequences.free(request_id)
        self.model.forget(request_id)
        if self.queue is not None:
            self.queue.pump()

    def remove_worker(self, worker_id: int) -> None:
        """The worker left discovery: forget its cache and its bookings."""
        self.indexer.remove_worker(worker_id)
        self.sequences.remove_worker(worker_id)
        self.model.remove_worker(worker_id)
        if self.affinity is not None:
            self.affinity.remove_worker(worker_id)
        self.dp_sizes.pop(worker_id, None)
        self.max_batched_tokens.pop(worker_id, None)
        self.kv_blocks.pop(worker_id, None)
        self._candidates = [key for key in self._candidates if key[0] != worker_id]

    async def close(self) -> None:
        if self._consumer is not None:
            self._consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._consumer
        if self._subscriber is not None:
            await self._subscriber.close()
