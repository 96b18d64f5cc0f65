"""The decoding loop of `out=llamacpp`: one thread drives one llama.cpp context whose sequences
are the engine's concurrent requests (docs/engines/llamacpp.md says what a user sees).

Why one thread and one context: llama.cpp computes a batch holding tokens of several sequences
in one graph, so eight requests decoding together cost one pass over the weights per step instead
of eight, and the weights are loaded once. A context is not thread-safe, so exactly one thread
touches it: this loop. It repeats one step:

1. take in what the event loop handed over (`submit`): waiting jobs go into free sequences most
   urgent first (the request's priority, higher first; arrival order among equals); jobs stopped
   meanwhile (cancelled, aborted, or the engine closing) end here;
2. build one `llama_batch`: first the one token each generating sequence has to evaluate (so that
   a long prompt never stalls the streams already running), then prompt chunks of the sequences
   still prefilling, the most urgent first, up to `n_batch` tokens in all; `logits` is set only
   on a sequence's last token of the step when that token finishes what it had to evaluate;
3. one `llama_decode` for all of them;
4. for each sequence with logits, its own sampler chain samples from its row
   (`llama_sampler_sample(chain, ctx, i)`), checks the stop conditions and streams the token.

A job is a `Job`: the thread appends tokens and finally sets `final` (or `error`); the event loop
is woken at most once per batch of tokens it has not yet read, so tokens produced while the
consumer is busy travel in one chunk and the event loop never blocks on llama.cpp (whose ctypes
calls release the GIL). The wakeups of a step go in ONE `loop.call_soon_threadsafe` for all its
jobs: each such call writes to the event loop's self-pipe, and on a busy machine the thread then
waits for the GIL back from the event loop; once per job it cost as much as the decoding.

Prefix reuse: a sequence keeps its KV cells after its request ends, and `Seq.tokens` says which
ids they hold. A job goes to the free sequence sharing the longest prefix with its prompt; when a
busy or other sequence shares a longer one, that prefix is copied into the chosen sequence with
`llama_memory_seq_cp` first (with the unified KV cache the engine builds, that adds the sequence
to the cells' owners, it copies no data). The rest of the free sequence is dropped with
`llama_memory_seq_rm`; at least one prompt token is always evaluated, for fresh logits. A model
whose memory is recurrent cannot drop part of a sequence: it starts from an empty one.

LoRA adapters: llama.cpp applies adapters to the whole context (`llama_set_adapters_lora`), not
per sequence, so a step decodes the sequences of one adapter (or of none) only, and the adapters
of the running requests take turns step by step, as llama.cpp's server batches only requests of
equal adapters together. A sequence's cells remember the adapter they were computed with: a
prefix is reused only for a request of the same adapter.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import KvImportError
from dynamo_graph.backend.errors import EngineError, EngineShutdown
from dynamo_graph.backend.protocol import CompletionUsage, FinishReason, SamplingOptions, TopLogprob
from dynamo_graph.engines.llamacpp.guided import token_logprobs
from dynamo_graph.engines.llamacpp.state import export_sequence, import_sequence
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.kv_transfer import KvHandoff

log = logging.getLogger("dynamo_graph.engines.llamacpp")


class Job:
    """A request's state, shared between the event loop and the loop's thread."""

    __slots__ = (
        "adapter",
        "cached",
        "cancelled",
        "context",
        "end_ids",
        "error",
        "export",
        "exported",
        "final",
        "generated",
        "grammar",
        "handoff",
        "lock",
        "logprobs",
        "loop",
        "max_tokens",
        "min_tokens",
        "notified",
        "pending",
        "pending_logprobs",
        "priority",
        "prompt",
        "sampling",
        "stop_ids",
        "wakeup",
    )

    def __init__(
        self,
        context: Context,
        prompt: list[int],
        *,
        max_tokens: int,
        min_tokens: int,
        stop_ids: frozenset[int],
        sampling: SamplingOptions,
        loop: asyncio.AbstractEventLoop,
        handoff: KvHandoff | None = None,
        export: bool = False,
        grammar: str | None = None,
        logprobs: int | None = None,
        end_ids: frozenset[int] = frozenset(),
        adapter: Any = None,
        priority: int = 0,
    ) -> None:
        self.context = context
        self.priority = priority  # higher is more urgent (Dynamo's sign)
        self.adapter = adapter  # the LoRA adapter (llama_adapter_lora_p) to decode with, or None
        self.grammar = grammar
        # End-of-generation ids that end the request unsent (a complete grammar allows only them).
        self.end_ids = end_ids
        self.logprobs = logprobs  # None: not asked; else how many top alternatives
        self.pending_logprobs: list[tuple[float, list[TopLogprob]]] = []
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_ids = stop_ids
        self.sampling = sampling
        self.loop = loop
        self.lock = threading.Lock()
        self.wakeup = asyncio.Event()
        self.pending: list[int] = []
        self.notified = False
        self.final: FinishReason | None = None
        self.error: BaseException | None = None
        self.cached = 0
        self.generated = 0
        self.cancelled = False  # set by abort() or when the consumer goes away
        self.handoff = handoff  # the prompt's KV, computed elsewhere: load it instead of evaluating
        self.export = export  # a prefill: stop after the first token and export the prompt's KV
        self.exported: KvHandoff | None = None

    def stopped(self) -> bool:
        return self.cancelled or self.context.is_stopped()

    # -- thread side: True when the consumer has to be woken (BatchLoop._flush does it)
    def emit(
        self,
        token: int | None = None,
        final: FinishReason | None = None,
        logprobs: tuple[float, list[TopLogprob]] | None = None,
    ) -> bool:
        with self.lock:
            if token is not None:
                self.pending.append(token)
            if logprobs is not None:
                self.pending_logprobs.append(logprobs)
            if final is not None:
                self.final = final
            wake = not self.notified
            self.notified = True
        return wake

    def fail(self, err: BaseException) -> bool:
        self.error = err
        return self.emit()

    # -- event loop side
    def take(self) -> tuple[list[int], list[tuple[float, list[TopLogprob]]], FinishReason | None]:
        self.wakeup.clear()
        with self.lock:
            tokens, self.pending = self.pending, []
            logprobs, self.pending_logprobs = self.pending_logprobs, []
            self.notified = False
            return tokens, logprobs, self.final

    def usage(self) -> CompletionUsage:
        return CompletionUsage(
            prompt_tokens=len(self.prompt), completion_tokens=self.generated, cached_tokens=self.cached
        )


class Seq:
    """One sequence id of the context: the ids its KV cells hold and, while busy, its job."""

    __slots__ = ("adapter", "chains", "id", "job", "todo", "tokens")

    def __init__(self, seq_id: int) -> None:
        self.id = seq_id
        self.adapter: Any = None  # the LoRA adapter its cells were computed with
        self.tokens: list[int] = []  # the ids whose KV the sequence holds, positions 0..n-1
        self.job: Job | None = None
        self.todo: list[int] = []  # what is left to evaluate: the prompt's rest, or the last token
        self.chains: list[Any] = []  # sampler chains: [normal] or [normal, with stop ids banned]


class BatchLoop:
    """The thread that owns the context (see the module docstring). `samplers(job)` builds a
    job's sampler chains; `kv_format` names the handoffs it exports."""

    def __init__(
        self,
        lc: Any,
        ctx: Any,
        *,
        n_seq: int,
        n_batch: int,
        recurrent: bool,
        prefix_reuse: bool,
        kv_format: str,
        n_vocab: int,
        samplers: Any,
    ) -> None:
        self._lc = lc
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._n_batch = n_batch
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._reuse = prefix_reuse and not recurrent
        self._kv_format = kv_format
        self._n_vocab = n_vocab
        self._samplers = samplers
        self._seqs = [Seq(i) for i in range(n_seq)]
        self.evaluated = 0  # prompt tokens evaluated (not taken from a cache or a handoff)
        self.steps = 0  # llama_decode calls: one per step, whatever the number of sequences in it
        self._applied: Any = None  # the LoRA adapter set on the context now
        self._waiting: deque[Job] = deque()
        self._woken: list[Job] = []  # jobs with output whose consumers _flush() wakes
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="llamacpp-batch", daemon=True)
        self._thread.start()

    # ---- the event loop's side -------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise EngineShutdown("the llamacpp engine shut down")
            self._waiting.append(job)
            self._cond.notify()

    def close(self, timeout: float) -> bool:
        """Stop the thread: running jobs end "cancelled", waiting ones fail with EngineShutdown.
        False if it did not stop in time (the context must then not be freed). Blocking."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._lc.llama_batch_free(self._batch)
        return True

    # ---- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._waiting and not self._busy():
                    self._cond.wait()
                if self._closing:
                    break
                arrived = list(self._waiting)
                self._waiting.clear()
            self._admit(arrived)
            try:
                self._step()
            except Exception as err:  # a bug, or llama.cpp refusing something: no request hangs
                log.exception("llamacpp: decoding failed")
                for seq in self._busy():
                    self._drop(seq)
                    self._end(seq, error=EngineError(f"llama.cpp failed: {err}"))
            self._flush()
        for seq in self._busy():
            self._end(seq, final="cancelled")
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        for job in waiting:
            self._notify(job, job.fail(EngineShutdown("the llamacpp engine shut down")))
        self._flush()

    def _notify(self, job: Job, wake: bool) -> None:
        if wake:
            self._woken.append(job)

    def _flush(self) -> None:
        """Wake the consumers of the jobs that got output: one call per event loop."""
        woken, self._woken = self._woken, []
        by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
        for job in woken:
            by_loop.setdefault(job.loop, []).append(job)
        for loop, jobs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake, jobs)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                for job in jobs:
                    job.cancelled = True

    def _busy(self) -> list[Seq]:
        return [seq for seq in self._seqs if seq.job is not None]

    def _admit(self, arrived: list[Job]) -> None:
        """The waiting jobs (oldest first): stopped ones end here, the others take free sequences
        most urgent first, in arrival order among equals; those left wait on, ahead of any
        submitted meanwhile (which the next call orders with them)."""
        if not arrived:
            return
        queue = [job for job in arrived if not self._cancel_waiting(job)]
        queue.sort(key=_urgency)  # stable: arrival order among equal priorities
        free = [seq for seq in self._seqs if seq.job is None]
        while queue and free:
            job = queue.pop(0)
            # The longest usable prefix; among equals, the sequence holding least (keep caches).
            seq = (
                max(free, key=lambda s: (_cached_prefix(s, job), -len(s.tokens))) if self._reuse else free[0]
            )
            free.remove(seq)
            self._start(seq, job)
        with self._cond:
            self._waiting.extendleft(reversed(queue))

    def _cancel_waiting(self, job: Job) -> bool:
        if job.stopped():
            self._notify(job, job.emit(final="cancelled"))
            return True
        return False

    def _start(self, seq: Seq, job: Job) -> None:
        """Put the KV of the prompt's start in place in `seq` (a handoff's, or a cached prefix)
        and set what is left to evaluate."""
        prompt = job.prompt
        seq.job = job
        try:
            if job.handoff is not None:
                seq.tokens = []  # whatever happens next, the sequence's old cells are gone
                import_sequence(self._lc, self._ctx, job.handoff, seq.id)
                reuse = job.handoff.num_tokens
            else:
                reuse = self._reuse_prefix(seq, job)
            seq.adapter = job.adapter
            seq.tokens = prompt[:reuse]
            seq.todo = prompt[reuse:]
            job.cached = reuse
            seq.chains = self._samplers(job)
            if job.handoff is not None:
                # The prefill's first token (and any after the handoff) were generated, not given:
                # the penalties count them, as they did on the prefill worker.
                for token in seq.todo:
                    for chain in seq.chains:
                        self._lc.llama_sampler_accept(chain.sampler, token)
        except KvImportError as err:
            self._drop(seq)
            self._end(seq, error=err)
            return
        except Exception as err:  # only this request fails: the others run on
            log.exception("llamacpp: starting request %s failed", job.context.id)
            self._drop(seq)
            self._end(seq, error=EngineError(f"llama.cpp failed: {err}"))
            return
        log.debug(
            "request %s: %d prompt tokens, %d from %s, %d evaluated (sequence %d)",
            job.context.id,
            len(prompt),
            reuse,
            "a KV handoff" if job.handoff is not None else "the context's cache",
            len(prompt) - reuse,
            seq.id,
        )

    def _reuse_prefix(self, seq: Seq, job: Job) -> int:
        """Keep (or copy in from another sequence) the longest cached prefix of the job's prompt
        computed with its LoRA adapter, short of its last token; drop the rest of `seq`.
        Returns its length."""
        if not self._reuse:
            self._drop(seq)
            return 0
        limit = len(job.prompt) - 1
        own = min(_cached_prefix(seq, job), limit)
        donor = max(self._seqs, key=lambda s: _cached_prefix(s, job))
        shared = min(_cached_prefix(donor, job), limit)
        if shared > own:
            self._lc.llama_memory_seq_rm(self._mem, seq.id, -1, -1)
            self._lc.llama_memory_seq_cp(self._mem, donor.id, seq.id, 0, shared)
            return shared
        if not self._lc.llama_memory_seq_rm(self._mem, seq.id, own, -1):
            self._drop(seq)
            return 0
        return own

    def _drop(self, seq: Seq) -> None:
        """Forget all the sequence holds (its cells may hold half a batch)."""
        self._lc.llama_memory_seq_rm(self._mem, seq.id, -1, -1)
        seq.tokens = []
        seq.todo = []

    def _end(
        self,
        seq: Seq,
        token: int | None = None,
        final: FinishReason | None = None,
        error: BaseException | None = None,
        logprobs: tuple[float, list[TopLogprob]] | None = None,
    ) -> None:
        job = seq.job
        seq.job = None
        seq.todo = []
        for chain in seq.chains:
            chain.close()
        seq.chains = []
        if job is None:
            return
        self._notify(job, job.fail(error) if error is not None else job.emit(token, final, logprobs))

    def _step(self) -> None:
        """One batch, one llama_decode, and the sampling that follows."""
        for seq in self._busy():
            if seq.job is not None and seq.job.stopped():
                self._end(seq, final="cancelled")
        busy = self._busy()
        if not busy:
            return
        busy = self._adapter_turn(busy)
        # Generating sequences first (one token each), then prompts, the most urgent first.
        busy.sort(key=lambda seq: (_prefilling(seq), _urgency(seq.job)))
        lc, batch = self._lc, self._batch
        n = 0
        taken: list[tuple[Seq, int, int]] = []  # (sequence, tokens taken, batch index of its logits or -1)
        for seq in busy:
            room = self._n_batch - n
            if room <= 0:
                break
            chunk = seq.todo[:room]
            pos = len(seq.tokens)
            for k, token in enumerate(chunk):
                batch.token[n + k] = token
                batch.pos[n + k] = pos + k
                batch.n_seq_id[n + k] = 1
                batch.seq_id[n + k][0] = seq.id
                batch.logits[n + k] = False
            last = n + len(chunk) - 1
            done = len(chunk) == len(seq.todo)
            batch.logits[last] = done
            taken.append((seq, len(chunk), last if done else -1))
            n += len(chunk)
        batch.n_tokens = n
        ret = lc.llama_decode(self._ctx, batch)
        self.steps += 1
        if ret != 0:
            err = EngineError(f"llama.cpp failed: llama_decode returned {ret}")
            for seq, _, _ in taken:
                self._drop(seq)
                self._end(seq, error=err)
            return
        for seq, count, index in taken:
            job = seq.job
            assert job is not None
            pos = len(seq.tokens)
            self.evaluated += max(0, min(len(job.prompt), pos + count) - pos)
            seq.tokens.extend(seq.todo[:count])
            seq.todo = seq.todo[count:]
            if index >= 0:
                self._sample(seq, job, index)

    def _adapter_turn(self, busy: list[Seq]) -> list[Seq]:
        """The sequences of this step: a context decodes with one set of LoRA adapters, so
        requests of different adapters (or none) take turns, one step each; the context is set
        to this turn's adapter."""
        groups: list[Any] = []
        for seq in busy:
            adapter = seq.job.adapter if seq.job is not None else None
            if not any(adapter is g for g in groups):
                groups.append(adapter)
        turn = groups[self.steps % len(groups)]
        if turn is not self._applied:
            lc = self._lc
            if turn is None:
                ret = lc.llama_set_adapters_lora(self._ctx, None, 0, None)
            else:
                adapters = (lc.llama_adapter_lora_p_ctypes * 1)(turn)
                ret = lc.llama_set_adapters_lora(self._ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
            if ret != 0:
                raise EngineError(
                    f"llama.cpp could not set the LoRA adapter (llama_set_adapters_lora: {ret})"
                )
            self._applied = turn
        return [seq for seq in busy if seq.job is not None and seq.job.adapter is turn]

    def _sample(self, seq: Seq, job: Job, index: int) -> None:
        lc = self._lc
        chains = seq.chains
        banning = job.generated < job.min_tokens and len(chains) > 1
        chain = chains[1] if banning else chains[0]
        token = lc.llama_sampler_sample(chain.sampler, self._ctx, index)  # also accepts it
        for other in chains:
            if other is not chain:  # keep the penalties' history the same in both
                lc.llama_sampler_accept(other.sampler, token)
        if token in job.end_ids and token not in job.stop_ids:
            self._end(seq, final="stop")  # the grammar is complete: end-of-generation only
            return
        job.generated += 1
        logprobs = None
        if job.logprobs is not None:
            logprobs = token_logprobs(lc, self._ctx, index, self._n_vocab, token, job.logprobs)
        if token in job.stop_ids and job.generated > job.min_tokens:
            self._end(seq, token, "stop", logprobs=logprobs)
        elif job.generated >= job.max_tokens:
            self._end(seq, token, "length", logprobs=logprobs)
        elif job.export:  # a prefill not finished at its first token: it goes on elsewhere
            try:
                job.exported = export_sequence(lc, self._ctx, self._kv_format, job.prompt, seq.id)
            except RuntimeError as err:
                self._end(seq, error=EngineError(f"llama.cpp failed: {err}"))
                return
            self._end(seq, token, "length", logprobs=logprobs)
        else:
            self._notify(job, job.emit(token, logprobs=logprobs))
            seq.todo = [token]


def _wake(jobs: list[Job]) -> None:
    for job in jobs:
        job.wakeup.set()


def _urgency(job: Job | None) -> int:
    """Sort key: the most urgent job first."""
    return 0 if job is None else -job.priority


def _prefilling(seq: Seq) -> bool:
    return seq.job is not None and len(seq.tokens) < len(seq.job.prompt)


def _cached_prefix(seq: Seq, job: Job) -> int:
    """How much of the job's prompt the sequence's cells hold, computed with the job's adapter."""
    return _common_prefix(seq.tokens, job.prompt) if seq.adapter is job.adapter else 0


def _common_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    n = min(len(cached), len(prompt))
    i = 0
    while i < n and cached[i] == prompt[i]:
        i += 1
    return i
