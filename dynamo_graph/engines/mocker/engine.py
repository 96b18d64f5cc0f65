"""`out=mocker`: a simulated vLLM worker behind the `LLMEngine` contract (no GPU, no weights), so
routing, disaggregation and autoscaling can be built and measured on any machine. One asyncio
task per data-parallel rank runs its `Scheduler`; passes are timed by perf_model.py against a
deadline clock. What it simulates and how: docs/engines/mocker.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING

from dynamo_graph.backend.engine import EngineConfig, KvImportError, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.lora import LoraAdapter
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest, request_priority
from dynamo_graph.engines.kv_handoff import first_token_answer, first_token_request
from dynamo_graph.engines.mocker.args import MockerArgs, MockerArgsError, args_from_settings
from dynamo_graph.engines.mocker.metrics import MockerCollector
from dynamo_graph.engines.mocker.perf_model import PerfModel
from dynamo_graph.engines.mocker.scheduler import (
    MockSequence,
    Scheduler,
    StepResult,
    TokenSampler,
    sampling_seed,
)
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.router.kv.protocols import LoadMetrics
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 32_000
# Without a model context length nor max_model_len (e.g. a model without config.json).
DEFAULT_MAX_MODEL_LEN = 8192
# A rank further behind its deadline clock than this (an overloaded event loop) stops catching up.
MAX_LAG_S = 0.1
LOAD_INTERVAL_S = 0.005


class _Rank:
    __slots__ = ("last_load", "last_load_time", "scheduler", "task", "wakeup")

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.last_load: tuple[int, int, int, int] | None = None
        self.last_load_time = float("-inf")


class MockerEngine(LLMEngine):
    """A vLLM simulator; see the module docstring."""

    publishes_kv_events = True
    kv_transfer = True

    def __init__(
        self,
        args: MockerArgs | None = None,
        *,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        reserved_token_ids: Iterable[int] = (),
        default_max_model_len: int | None = None,
        perf_model: PerfModel | None = None,
        load_interval_s: float = LOAD_INTERVAL_S,
    ) -> None:
        self.args = args = args or MockerArgs()
        self.max_model_len = _resolve_max_model_len(args, default_max_model_len)
        self.vocab_size = vocab_size
        self.reserved_token_ids = frozenset(reserved_token_ids)
        if len({t for t in self.reserved_token_ids if 0 <= t < vocab_size}) >= vocab_size:
            raise ValueError(f"mocker: every id of the vocabulary ({vocab_size}) is a special token")
        self.perf_model = perf_model
        self.load_interval_s = load_interval_s
        self.worker_id = 0
        self._ranks: list[_Rank] = []
        self._seqs: dict[Context, tuple[MockSequence, _Rank]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._started = False
        self._closed = False
        self.adapters: dict[str, LoraAdapter] = {}

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> MockerEngine:
        args = args_from_settings(cfg)
        if model is None:
            return cls(args)
        tokenizer = model.load_tokenizer()
        special = [i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special]
        return cls(
            args,
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            reserved_token_ids=[*special, *model.eos_token_ids],
            default_max_model_len=model.context_length,
        )

    # ---- lifecycle ---------------------------------------------------------------------

    def config(self) -> EngineConfig:
        a = self.args
        return EngineConfig(
            model_input="tokens",
            context_length=self.max_model_len,
            kv_cache_block_size=a.block_size,
            total_kv_blocks=a.num_gpu_blocks,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            data_parallel_size=a.dp_size,
            capabilities=["logprobs"],
        )

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the mocker engine was shut down")
        if not self._started:
            self.worker_id = worker_id
            for dp_rank in range(self.args.dp_size):
                scheduler = Scheduler(
                    self.args, max_model_len=self.max_model_len, dp_rank=dp_rank, perf_model=self.perf_model
                )
                rank = _Rank(scheduler)
                rank.task = asyncio.create_task(self._run_rank(rank), name=f"mocker dp rank {dp_rank}")
                self._ranks.append(rank)
            self._started = True
        return self.config()

    def metrics_collectors(self) -> Sequence[Collector]:
        return (MockerCollector(lambda: [rank.scheduler for rank in self._ranks]),)

    async def drain(self) -> None:
        while self._seqs:
            self._idle.clear()
            await self._idle.wait()

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [rank.task for rank in self._ranks if rank.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for seq, _ in list(self._seqs.values()):
            _put(seq, EngineShutdown("the mocker engine shut down"))
        sink = self.kv_event_sink
        for rank in self._ranks:
            rank.scheduler.cancel_all()
            rank.scheduler.kv.clear()
            if sink is not None:
                with contextlib.suppress(Exception):
                    sink.cleared(rank.scheduler.dp_rank)

    async def load_lora(self, adapter: LoraAdapter) -> None:
        """Any adapter path is accepted: an adapter changes which tokens a request draws (its
        id is mixed into the seed), deterministically, as a real one changes greedy output."""
        self.adapters[adapter.name] = adapter

    async def unload_lora(self, name: str) -> None:
        self.adapters.pop(name, None)

    async def abort(self, context: Context) -> None:
        entry = self._seqs.get(context)
        if entry is not None:
            seq, rank = entry
            rank.scheduler.cancel(seq)
            rank.wakeup.set()

    # ---- requests ----------------------------------------------------------------------

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if not isinstance(request, PreprocessedRequest):
            raise InvalidArgument("the mocker takes pre-processed requests (token ids)", param="model")
        if self._closed:
            raise EngineShutdown("the mocker engine shut down")
        if not self._started:
            raise EngineError("the mocker engine is not started")
        async for out in self._run(request, context, self._choose_rank(request)):
            yield out

    async def _run(
        self, request: PreprocessedRequest, context: Context, rank: _Rank, *, transferred: bool = False
    ) -> AsyncIterator[LLMEngineOutput]:
        seq = self._sequence(request, context)
        seq.transferred = transferred
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=seq.usage())
            return
        self._seqs[context] = (seq, rank)
        self._idle.clear()
        rank.scheduler.add(seq)
        rank.wakeup.set()
        loop = asyncio.get_running_loop()
        outbox = seq.outbox
        try:
            while True:
                while outbox:
                    item = outbox.popleft()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finish_reason is not None:
                        return
                seq.waiter = waiter = loop.create_future()
                await waiter
        finally:
            if not seq.finished:  # our consumer went away (or was cancelled): free its blocks
                rank.scheduler.cancel(seq)
                rank.wakeup.set()
            if self._seqs.get(context, (None,))[0] is seq:
                del self._seqs[context]
            if not self._seqs:
                self._idle.set()

    # ---- disaggregated prefill/decode ----------------------------------------------------

    @property
    def kv_format(self) -> str:
        return f"mocker/1:block_size={self.args.block_size}"

    async def prefill(
        self, request: PreprocessedRequest, context: Context
    ) -> tuple[LLMEngineOutput, KvHandoff | None]:
        """The prompt's prefill and first token, timed as any request's; the handoff carries the
        prompt's token ids (so the decode side can check what it imports) and stands for
        `kv_bytes_per_token` bytes per prompt token."""
        answer, goes_on = await first_token_answer(
            self.generate(first_token_request(request), context), request
        )
        if not goes_on:
            return answer, None  # the request ended at its first token (or was cancelled)
        prompt = request.token_ids
        handoff = KvHandoff(
            self.kv_format,
            len(prompt),
            array("I", prompt).tobytes(),
            nbytes=len(prompt) * self.args.kv_bytes_per_token,
        )
        return answer, handoff

    async def generate_from_kv(  # type: ignore[override]
        self, request: PreprocessedRequest, handoff: KvHandoff, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Wait out the simulated transfer (`nbytes` at `kv_transfer_gb_per_s`), put the prompt's
        blocks into the chosen rank's cache as computed (stored events published), then run the
        request: only what follows the transferred prefix is computed."""
        if handoff.format != self.kv_format:
            raise KvImportError(f"a {handoff.format!r} handoff cannot be loaded by {self.kv_format!r}")
        prefix = request.token_ids[: handoff.num_tokens]
        if array("I", prefix).tobytes() != handoff.data:
            raise KvImportError("the handoff's tokens are not this request's prompt")
        if self._closed:
            raise EngineShutdown("the mocker engine shut down")
        rank = self._choose_rank(request)
        seconds = handoff.size / (self.args.kv_transfer_gb_per_s * 1e9) / self.args.speedup_ratio
        if seconds > 0:
            await asyncio.sleep(seconds)
        adapter = request.model if request.model in self.adapters else None
        transferred = rank.scheduler.import_prefix(prefix, adapter, request.cache_salt)
        async for out in self._run(request, context, rank, transferred=transferred):
            yield out

    def _choose_rank(self, request: PreprocessedRequest) -> _Rank:
        ranks = self._ranks
        if request.dp_rank is not None:
            if not 0 <= request.dp_rank < len(ranks):
                raise InvalidArgument(
                    f"dp_rank {request.dp_rank} is out of range: this worker has {len(ranks)} "
                    f"data-parallel rank{'s' if len(ranks) > 1 else ''} (0..{len(ranks) - 1})",
                    param="dp_rank",
                )
            return ranks[request.dp_rank]
        if len(ranks) == 1:
            return ranks[0]
        return min(ranks, key=lambda r: (r.scheduler.load(), r.scheduler.kv.used))

    def _sequence(self, request: PreprocessedRequest, context: Context) -> MockSequence:
        prompt = request.token_ids
        n = len(prompt)
        if n == 0:
            raise InvalidArgument("the prompt is empty: at least one token is needed", param="prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param="token_ids"
            )
        if n >= self.max_model_len:
            raise InvalidArgument(
                f"the prompt has {n} tokens; this worker's max_model_len {self.max_model_len} "
                f"(prompt + output, limited by the KV cache of {self.args.num_gpu_blocks} blocks of "
                f"{self.args.block_size} tokens) leaves no room for output: at most "
                f"{self.max_model_len - 1} prompt tokens",
                param="prompt",
            )
        sc = request.stop_conditions
        room = self.max_model_len - n
        if sc.max_tokens is not None and sc.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, not {sc.max_tokens}", param="max_tokens")
        max_tokens = room if sc.max_tokens is None else min(sc.max_tokens, room)
        if sc.min_tokens is not None and sc.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be at least 0, not {sc.min_tokens}", param="min_tokens")
        asked = frozenset(sc.stop_token_ids or ())
        hidden = frozenset((*request.eos_token_ids, *(sc.stop_token_ids_hidden or ())))
        stop_ids = asked if sc.ignore_eos else asked | hidden
        reserved = self.reserved_token_ids | hidden
        if asked:
            reserved = reserved - asked
        seed = sampling_seed(prompt, request.sampling_options.seed)
        adapter = self.adapters.get(request.model)
        sampler = TokenSampler(
            seed if adapter is None else seed ^ adapter.lora_id,
            self.vocab_size,
            reserved,
            top_logprobs=request.output_options.logprobs,
        )
        return MockSequence(
            context,
            prompt,
            max_tokens=max_tokens,
            min_tokens=sc.min_tokens or 0,
            stop_ids=stop_ids,
            sampler=sampler,
            adapter=None if adapter is None else adapter.name,
            priority=request_priority(request),
            salt=request.cache_salt,
        )

    # ---- the forward-pass loop of one rank ---------------------------------------------

    async def _run_rank(self, rank: _Rank) -> None:
        loop = asyncio.get_running_loop()
        scheduler = rank.scheduler
        speedup = self.args.speedup_ratio
        deadline: float | None = None
        while True:
            if not scheduler.has_work():
                self._publish_load(rank, force=True)
                deadline = None
                rank.wakeup.clear()
                await rank.wakeup.wait()
                continue
            try:
                result = scheduler.step()
            except Exception:  # a bug must not hang every request of the rank
                log.exception("mocker dp rank %d: scheduler step failed", scheduler.dp_rank)
                for seq in scheduler.cancel_all():
                    _put(seq, EngineError("the mocker's scheduler failed; see the worker's log"))
                continue
            now = loop.time()
            if deadline is None or now - deadline > MAX_LAG_S:
                deadline = now
            deadline += result.duration_ms / speedup / 1000.0
            delay = deadline - now
            await asyncio.sleep(delay if delay > 0 else 0)
            for seq, out in result.outputs:
                _put(seq, out)
            self._publish(rank, result)

    def _publish(self, rank: _Rank, result: StepResult) -> None:
        sink = self.kv_event_sink
        if sink is None:
            return
        dp_rank = rank.scheduler.dp_rank
        try:
            for event in result.events:
                if event[0] == "stored":
                    sink.stored(event[1], event[2], dp_rank, event[3])
                else:
                    sink.removed(event[1], dp_rank)
        except Exception as err:  # the event plane's trouble is not the requests' trouble
            log.warning("mocker: publishing KV events failed: %s", err)
        self._publish_load(rank)

    def _publish_load(self, rank: _Rank, *, force: bool = False) -> None:
        sink = self.kv_event_sink
        if sink is None:
            return
        scheduler = rank.scheduler
        snapshot = (
            scheduler.kv.used,
            len(scheduler.waiting),
            len(scheduler.running),
            scheduler.prefill_backlog(),
        )
        if snapshot == rank.last_load:
            return
        now = asyncio.get_running_loop().time()
        if not force and now - rank.last_load_time < self.load_interval_s:
            return
        rank.last_load, rank.last_load_time = snapshot, now
        metrics = LoadMetrics(
            worker_id=self.worker_id,
            active_blocks=snapshot[0],
            total_blocks=self.args.num_gpu_blocks,
            waiting=snapshot[1],
            running=snapshot[2],
            dp_rank=scheduler.dp_rank,
            prefill_tokens=snapshot[3],
        )
        try:
            sink.load(metrics)
        except Exception as err:
            log.warning("mocker: publishing load metrics failed: %s", err)


def _put(seq: MockSequence, item: LLMEngineOutput | BaseException) -> None:
    seq.outbox.append(item)
    waiter = seq.waiter
    if waiter is not None:
        seq.waiter = None
        if not waiter.done():
            waiter.set_result(None)


def _resolve_max_model_len(args: MockerArgs, default: int | None) -> int:
    """max_model_len, checked against what the KV cache (and the batch, without chunked prefill)
    can hold: an explicit value that does not fit is an error, a derived one is lowered."""
    if args.admission_blocks < 1:
        raise MockerArgsError(
            f"--extra-engine-args: num_gpu_blocks {args.num_gpu_blocks} with watermark {args.watermark} "
            "leaves no KV block to admit a request"
        )
    explicit = args.max_model_len is not None
    max_len = args.max_model_len or default or DEFAULT_MAX_MODEL_LEN
    limits = [
        (
            args.admission_blocks * args.block_size,
            f"the KV cache holds under the watermark ({args.admission_blocks} of num_gpu_blocks "
            f"{args.num_gpu_blocks} blocks of {args.block_size} tokens)",
            "num_gpu_blocks",
        )
    ]
    if not args.enable_chunked_prefill:
        limits.append(
            (args.max_num_batched_tokens, "one batch holds without chunked prefill", "max_num_batched_tokens")
        )
    for limit, what, knob in limits:
        if max_len <= limit:
            continue
        if explicit:
            raise MockerArgsError(
                f"--extra-engine-args: max_model_len {max_len} is more than {what}: {limit} tokens; "
                f"lower max_model_len or raise {knob}"
            )
        log.warning("mocker: max_model_len lowered from %d to %d: that is what %s", max_len, limit, what)
        max_len = limit
    if max_len < 2:
        raise MockerArgsError(f"--extra-engine-args: max_model_len {max_len} leaves no room for a prompt")
    return max_len
