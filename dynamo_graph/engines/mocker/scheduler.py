"""One data-parallel rank of the mocker: a vLLM (v1) style scheduler over a `KvManager`.

`Scheduler.step()` plans and "runs" one forward pass, synchronously; the engine calls it in a
loop and sleeps for the pass's simulated time (perf_model.py). A step:

1. **Reap**: sequences whose context is stopped (or whose consumer went away) leave: their
   blocks are released and their stream ends with finish_reason "cancelled".
2. **Running first** (in admission order, whatever their priority, as vLLM), within the token
   budget `max_num_batched_tokens`: a sequence still in prefill gets its next chunk (the rest of
   its new tokens, or what the budget leaves with chunked prefill); a decoding sequence gets one
   token. A decoding sequence whose next token crosses into a new block needs one more block;
   when none can be had (even by evicting cached blocks), a running sequence is preempted: with
   `scheduling_policy` fcfs the *newest* (vLLM v1's `running[-1]`), with priority the least
   urgent, latest-arrived one (vLLM's `max(running, key=(priority, arrival_time))`), whose chunk
   already planned this step, if any, is given back to the budget. The victim's blocks are freed
   and it goes back to the waiting queue (fcfs: at its head; priority: by its key), keeping the
   tokens it generated; it is recomputed (prompt + output, with whatever is still cached) when
   admitted again. If the victim is the sequence itself, it waits and no more running sequences
   are scheduled this step.
3. **Admission** (only when nothing was preempted this step, as vLLM v1), from the head of the
   waiting queue (queues.py: fcfs is arrival order; priority is most urgent first, arrival order
   among equals; a waiting request never preempts a running one, as in vLLM v1) while the token
   budget is not spent and fewer than `max_num_seqs` run. A
   request is admitted when its blocks fit under the watermark — blocks held by running
   sequences + blocks it needs (all blocks of its tokens, less cached blocks that are already
   active) <= (1 - watermark) * num_gpu_blocks — and, without chunked prefill, its new tokens fit
   the remaining budget. The first that does not fit stops admission (head-of-line blocking).
   The longest cached prefix of full blocks is reused (at most (len-1)//block_size blocks: as in
   vLLM, the last token is always computed to get logits); blocks for the whole prompt are
   allocated at admission (as Dynamo's mocker), so a chunked prefill never waits for memory.
4. **Execute**: computed tokens advance; every block that became full is registered by its
   sequence hash and reported in a `stored` event (one per sequence and step, parent = the
   previous block's hash); every sequence whose new tokens are now all computed samples one
   token (a finished prefill samples its first token in the same pass, as vLLM does).

A sequence finishes on a stop token (after `min_tokens`), at its token limit (`max_tokens`,
capped by max_model_len), or when cancelled; its blocks are then released (full ones stay
cached). Per-step work is linear in the running sequences; hashing is one xxh3 per filled block.

Generated tokens are pseudo-random but deterministic: a `random.Random` seeded by xxh3 of the
prompt's token ids (with the request's sampling seed as the hash seed), drawing uniformly from
the vocabulary except "reserved" ids: the tokenizer's special tokens, the model's and request's
eos ids and `stop_token_ids_hidden`. So a mocker never ends a sequence on eos by chance (like
Dynamo's mocker, it runs to its token limit, which makes load predictable), while ids the
request names in `stop_token_ids` stay drawable and stop it legitimately when drawn.
"""

from __future__ import annotations

import itertools
import math
import random
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xxhash import xxh3_64_intdigest

from dynamo_graph.backend.protocol import CompletionUsage, FinishReason, LLMEngineOutput, TopLogprob
from dynamo_graph.engines.mocker.args import MockerArgs
from dynamo_graph.engines.mocker.kv_manager import KvManager
from dynamo_graph.engines.mocker.perf_model import PerfModel, PolynomialPerfModel, iteration_ms
from dynamo_graph.engines.mocker.queues import FcfsQueue, PriorityQueue, waiting_queue
from dynamo_graph.router.kv.hashing import (
    chain_hash,
    local_block_hashes,
    lora_hash_seed,
    salted_seed,
    sequence_hashes,
)
from dynamo_graph.router.kv.protocols import StoredBlock
from dynamo_graph.runtime.context import Context

_U64 = (1 << 64) - 1


def sampling_seed(prompt: Sequence[int], seed: int | None = None) -> int:
    """The seed of a request's token stream: xxh3 of the prompt, keyed by the sampling seed."""
    return xxh3_64_intdigest(array("I", prompt).tobytes(), (seed or 0) & _U64)


class TokenSampler:
    """Uniform draws from [0, vocab_size) except `reserved` ids (rejection sampling).

    With `top_logprobs` set (the request asked for logprobs), each token's log-probability is
    that of the uniform distribution it was drawn from, -ln(drawable ids), and its top
    alternatives are itself then the next drawable ids after it: deterministic, and true."""

    __slots__ = ("_drawable", "_randrange", "_reserved", "_vocab", "top_logprobs")

    def __init__(
        self, seed: int, vocab_size: int, reserved: frozenset[int], top_logprobs: int | None = None
    ) -> None:
        drawable = vocab_size - len({t for t in reserved if 0 <= t < vocab_size})
        if drawable < 1:
            raise ValueError(f"no token id left to generate: vocab_size {vocab_size}, all reserved")
        self._randrange = random.Random(seed).randrange
        self._reserved = reserved
        self._vocab = vocab_size
        self._drawable = drawable
        self.top_logprobs = top_logprobs

    def logprobs(self, token: int) -> tuple[float, list[TopLogprob]]:
        """(log-probability of `token`, the `top_logprobs` most likely tokens) at its position."""
        logprob = -math.log(self._drawable)
        top: list[TopLogprob] = []
        candidate = token
        while len(top) < min(self.top_logprobs or 0, self._drawable):
            if candidate not in self._reserved:
                top.append(TopLogprob(token_id=candidate, logprob=logprob))
            candidate = (candidate + 1) % self._vocab
        return logprob, top

    def next(self) -> int:
        randrange, reserved = self._randrange, self._reserved
        token = randrange(self._vocab)
        while token in reserved:
            token = randrange(self._vocab)
        return token


def mock_token_ids(
    prompt: Sequence[int],
    count: int,
    *,
    vocab_size: int,
    reserved: Iterable[int] = (),
    seed: int | None = None,
) -> list[int]:
    """The first `count` tokens the mocker generates for `prompt` (for tests and tools)."""
    sampler = TokenSampler(sampling_seed(prompt, seed), vocab_size, frozenset(reserved))
    return [sampler.next() for _ in range(count)]


class MockSequence:
    """One request inside a scheduler: its tokens, progress, blocks and output channel."""

    __slots__ = (
        "adapter",
        "arrival",
        "cached_tokens",
        "cancelled",
        "context",
        "finished",
        "generated",
        "hash_seed",
        "in_prefill",
        "local_hashes",
        "max_tokens",
        "min_tokens",
        "num_cached",
        "num_computed",
        "num_private",
        "outbox",
        "preemptions",
        "priority",
        "prompt_len",
        "salt",
        "sampler",
        "seq_hashes",
        "stop_ids",
        "tokens",
        "transferred",
        "waiter",
    )

    def __init__(
        self,
        context: Context,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampler: TokenSampler,
        min_tokens: int = 0,
        stop_ids: frozenset[int] = frozenset(),
        adapter: str | None = None,
        priority: int = 0,
        salt: str | None = None,
    ) -> None:
        self.context = context
        self.priority = priority  # Dynamo's sign: higher is more urgent
        self.arrival = -1  # the rank's arrival counter, set when it is first queued
        # A LoRA adapter's name: its blocks are its own (their local hashes seeded by it, as the
        # kv router hashes them), so they never serve the base model or another adapter, and
        # their stored events name it.
        self.adapter = adapter
        self.hash_seed = lora_hash_seed(adapter)
        # The request's cache salt seeds its first block (hashing.py): no other salt's prefix
        # is ever a hit for it.
        self.salt = salt
        self.tokens: list[int] = list(prompt)
        self.prompt_len = len(self.tokens)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_ids = stop_ids
        self.sampler = sampler
        self.generated = 0
        self.num_computed = 0  # tokens whose KV is computed
        self.num_cached = 0  # leading blocks held as registered (hashed) blocks
        self.num_private = 0  # further blocks held privately
        self.in_prefill = True
        self.cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.preemptions = 0
        self.cancelled = False
        self.finished = False
        self.local_hashes: list[int] = []
        self.seq_hashes: list[int] = []
        self.outbox: deque[Any] = deque()  # LLMEngineOutput or an exception, for generate()
        self.waiter: Any = None  # the future generate() awaits while the outbox is empty
        # The prompt's KV arrived from a prefill worker (import_prefix): on admission only the
        # last token is computed, in a decode step, as a decode worker does after a transfer.
        self.transferred = False

    @property
    def held_blocks(self) -> int:
        return self.num_cached + self.num_private

    def hash_blocks(self, block_size: int) -> None:
        """Hashes of every full block of the known tokens (prompt + generated so far)."""
        self.local_hashes = local_block_hashes(self.tokens, block_size, self.hash_seed, self.salt)
        self.seq_hashes = sequence_hashes(self.local_hashes)

    def usage(self) -> CompletionUsage:
        return CompletionUsage(
            prompt_tokens=self.prompt_len, completion_tokens=self.generated, cached_tokens=self.cached_tokens
        )


@dataclass
class StepResult:
    """What one forward pass did: outputs to deliver and KV events to publish after it."""

    outputs: list[tuple[MockSequence, LLMEngineOutput]] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    prefill_tokens: int = 0
    decoding: int = 0
    kv_usage: float = 0.0
    duration_ms: float = 0.0
    preempted: int = 0


class Scheduler:
    """A rank's waiting queue, running batch and KV cache; see the module docstring."""

    def __init__(
        self, args: MockerArgs, *, max_model_len: int, dp_rank: int = 0, perf_model: PerfModel | None = None
    ) -> None:
        self.args = args
        self.dp_rank = dp_rank
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.perf_model: PerfModel = perf_model or PolynomialPerfModel()
        self.prefix_caching = args.enable_prefix_caching
        self.chunked = args.enable_chunked_prefill
        self.admission_blocks = args.admission_blocks
        self._events: list[Any] = []
        self.kv = KvManager(
            args.num_gpu_blocks, args.block_size, prefix_caching=self.prefix_caching, events=self._events
        )
        self.by_priority = args.scheduling_policy == "priority"
        self.waiting: FcfsQueue[MockSequence] | PriorityQueue[MockSequence] = waiting_queue(
            args.scheduling_policy
        )
        self.running: list[MockSequence] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0  # prompt tokens of sequences first admitted (for /metrics)
        self.prefix_hit_tokens = 0  # of those, found in the prefix cache
        self._arrivals = itertools.count()

    # ---- queue ---------------------------------------------------------------------------

    def add(self, seq: MockSequence) -> None:
        if self.prefix_caching and not seq.seq_hashes:
            seq.hash_blocks(self.block_size)
        seq.arrival = next(self._arrivals)
        self.waiting.add(seq)

    def cancel(self, seq: MockSequence) -> None:
        """Drop `seq` at the next step (its consumer is gone, or it was aborted)."""
        seq.cancelled = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def prefill_backlog(self) -> int:
        """Prompt tokens accepted and not yet computed (`LoadMetrics.prefill_tokens`): every
        token of a waiting sequence (a preempted one recomputes its output too; one whose KV was
        transferred computes its last token only), the rest of each running one in prefill."""
        waiting = sum(1 if s.transferred else len(s.tokens) for s in self.waiting)
        return waiting + sum(len(s.tokens) - s.num_computed for s in self.running if s.in_prefill)

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence this long can ever be admitted."""
        return -(-num_tokens // self.block_size) <= self.admission_blocks

    # ---- one forward pass ----------------------------------------------------------------

    def step(self) -> StepResult:
        result = StepResult(events=self._events)
        outputs = result.outputs
        self._reap(outputs)
        bs = self.block_size
        kv = self.kv
        running = self.running
        budget = self.args.max_num_batched_tokens
        # (sequence, tokens this pass, whether they are one decode token)
        scheduled: list[tuple[MockSequence, int, bool]] = []
        preempted = 0

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.in_prefill:
                chunk = min(len(seq.tokens) - seq.num_computed, budget)
            else:
                chunk = 1
                if seq.held_blocks * bs < len(seq.tokens):  # the new token starts a block
                    while not kv.allocate(1):
                        victim = self._victim()
                        at = running.index(victim)
                        del running[at]
                        if at < i:
                            i -= 1
                        budget += self._unschedule(scheduled, victim)
                        self._preempt(victim)
                        preempted += 1
                        if victim is seq:
                            break
                    if seq.in_prefill:  # preempted itself: nothing more runs this step
                        break
                    seq.num_private += 1
            scheduled.append((seq, chunk, not seq.in_prefill))
            budget -= chunk
            i += 1

        if not preempted:
            self._admit(scheduled, budget)
        prefill_tokens = sum(chunk for _, chunk, decode in scheduled if not decode)
        decoding = sum(1 for _, _, decode in scheduled if decode)

        finished = False
        for seq, chunk, _ in scheduled:
            seq.num_computed += chunk
            if self.prefix_caching:
                self._register_blocks(seq)
            if seq.num_computed == len(seq.tokens):
                seq.in_prefill = False
                out = self._sample(seq)
                outputs.append((seq, out))
                if seq.finished:
                    finished = True
        if finished:
            self.running = [s for s in running if not s.finished]

        result.prefill_tokens = prefill_tokens
        result.decoding = decoding
        result.preempted = preempted
        result.kv_usage = kv.usage()
        result.duration_ms = iteration_ms(self.perf_model, prefill_tokens, decoding, result.kv_usage)
        self._events = []
        kv.events = self._events
        return result

    def _victim(self) -> MockSequence:
        """The running sequence preempted for memory: the newest (fcfs), or the least urgent
        and, among those, latest-arrived (priority)."""
        if self.by_priority:
            return max(self.running, key=lambda s: (-s.priority, s.arrival))
        return self.running[-1]

    @staticmethod
    def _unschedule(scheduled: list[tuple[MockSequence, int, bool]], victim: MockSequence) -> int:
        """Take a preempted sequence's chunk out of this pass; the tokens given back."""
        for k, (seq, chunk, _) in enumerate(scheduled):
            if seq is victim:
                del scheduled[k]
                return chunk
        return 0

    def _admit(self, scheduled: list[tuple[MockSequence, int, bool]], budget: int) -> None:
        """Admit waiting sequences, from the head of the queue, within the budget."""
        bs, kv, waiting, running = self.block_size, self.kv, self.waiting, self.running
        max_seqs = self.args.max_num_seqs
        while waiting and budget > 0 and len(running) < max_seqs:
            seq = waiting.peek()
            length = len(seq.tokens)
            total = -(-length // bs)
            hit, active_hit = kv.match_prefix(seq.seq_hashes, (length - 1) // bs)
            new_tokens = length - hit * bs
            if not self.chunked and new_tokens > budget:
                break
            if kv.used + total - active_hit > self.admission_blocks:
                break
            waiting.pop()
            kv.acquire(seq.seq_hashes[:hit])
            allocated = kv.allocate(total - hit)
            assert allocated, "admission checked the capacity"
            seq.num_cached = hit
            seq.num_private = total - hit
            seq.num_computed = hit * bs
            seq.in_prefill = True
            if seq.cached_tokens is None:
                seq.cached_tokens = hit * bs
                self.prompt_tokens += length
                self.prefix_hit_tokens += hit * bs
            running.append(seq)
            if seq.transferred and hit == (length - 1) // bs:
                # Every block but the partial last one is here; that one came with the transfer.
                seq.num_computed = length - 1
                scheduled.append((seq, 1, True))
                budget -= 1
                continue
            seq.transferred = False  # evicted before admission: the rest is prefilled here
            chunk = min(new_tokens, budget)
            scheduled.append((seq, chunk, False))
            budget -= chunk

    def import_prefix(
        self, tokens: Sequence[int], adapter: str | None = None, salt: str | None = None
    ) -> bool:
        """The full blocks of `tokens` (of LoRA adapter `adapter`, None: the base model; of
        cache salt `salt`),
        computed by another worker (a KV transfer), become cached blocks of this rank as if it
        had computed them, and are reported as stored; a request for them then only computes
        what follows. False when they cannot be held (no prefix caching, or no room): the
        request then simply prefills."""
        if not self.prefix_caching:
            return False
        bs, kv = self.block_size, self.kv
        local = local_block_hashes(tokens, bs, lora_hash_seed(adapter), salt)
        seq = sequence_hashes(local)
        first = 0
        while first < len(seq) and kv.is_cached(seq[first]):
            first += 1
        new = len(seq) - first
        if new <= 0:
            return True
        if not kv.allocate(new):
            return False
        for h in seq[first:]:
            kv.promote(h)
        kv.release(seq[first:], 0)
        stored = [StoredBlock(seq[j], local[j]) for j in range(first, len(seq))]
        self._events.append(("stored", seq[first - 1] if first else None, stored, adapter))
        return True

    def _register_blocks(self, seq: MockSequence) -> None:
        """Blocks that became full and computed become cached blocks, and are reported."""
        first = seq.num_cached
        full = min(seq.num_computed // self.block_size, len(seq.seq_hashes))
        if full <= first:
            return
        kv = self.kv
        seq_hashes, local_hashes = seq.seq_hashes, seq.local_hashes
        blocks = []
        for j in range(first, full):
            kv.promote(seq_hashes[j])
            blocks.append(StoredBlock(seq_hashes[j], local_hashes[j]))
        seq.num_cached = full
        seq.num_private -= full - first
        self._events.append(("stored", seq_hashes[first - 1] if first else None, blocks, seq.adapter))

    def _sample(self, seq: MockSequence) -> LLMEngineOutput:
        token = seq.sampler.next()
        seq.tokens.append(token)
        seq.generated += 1
        bs = self.block_size
        if self.prefix_caching and len(seq.tokens) % bs == 0:
            seed = seq.hash_seed if seq.seq_hashes else salted_seed(seq.hash_seed, seq.salt)
            local = local_block_hashes(seq.tokens[-bs:], bs, seed)[0]
            seq.local_hashes.append(local)
            seq.seq_hashes.append(chain_hash(seq.seq_hashes[-1] if seq.seq_hashes else None, local))
        finish: FinishReason | None = None
        if token in seq.stop_ids and seq.generated > seq.min_tokens:
            finish = "stop"
        elif seq.generated >= seq.max_tokens:
            finish = "length"
        out = LLMEngineOutput(token_ids=[token])
        if seq.sampler.top_logprobs is not None:
            logprob, top = seq.sampler.logprobs(token)
            out.log_probs, out.top_logprobs = [logprob], [top]
        if seq.generated == 1:
            out.cached_tokens = seq.cached_tokens
        if finish is not None:
            out.finish_reason = finish
            out.completion_usage = seq.usage()
            self._finish(seq)
        return out

    def _finish(self, seq: MockSequence) -> None:
        seq.finished = True
        self._free(seq)

    def _free(self, seq: MockSequence) -> None:
        self.kv.release(seq.seq_hashes[: seq.num_cached], seq.num_private)
        seq.num_cached = seq.num_private = seq.num_computed = 0

    def _preempt(self, seq: MockSequence) -> None:
        self._free(seq)
        seq.in_prefill = True
        seq.transferred = False  # its transferred KV went with its blocks: recompute from the cache
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(seq)

    def _reap(self, outputs: list[tuple[MockSequence, LLMEngineOutput]]) -> None:
        """Remove cancelled sequences (stopped contexts are polled: cheap, one call each)."""

        def gone(seq: MockSequence) -> bool:
            return seq.cancelled or seq.context.is_stopped()

        if any(map(gone, self.running)):
            keep = []
            for seq in self.running:
                if gone(seq):
                    self._free(seq)
                    self._end_cancelled(seq, outputs)
                else:
                    keep.append(seq)
            self.running = keep
        if any(map(gone, self.waiting)):
            for seq in self.waiting.remove_if(gone):
                self._end_cancelled(seq, outputs)

    @staticmethod
    def _end_cancelled(seq: MockSequence, outputs: list[tuple[MockSequence, LLMEngineOutput]]) -> None:
        seq.finished = True
        outputs.append((seq, LLMEngineOutput(finish_reason="cancelled", completion_usage=seq.usage())))

    def cancel_all(self) -> list[MockSequence]:
        """Take every sequence out (shutdown); returns them."""
        seqs = [*self.running, *self.waiting]
        for seq in self.running:
            self._free(seq)
        self.running = []
        self.waiting.clear()
        for seq in seqs:
            seq.finished = True
        return seqs
