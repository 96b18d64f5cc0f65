"""`out=llamacpp`: a GGUF model run in-process by llama.cpp (llama-cpp-python), tokens in/out.

The frontend tokenizes and templates (the model card's tokenizer: tokenizer.json, or the one built
from the GGUF); this engine takes token ids and streams token ids back. llama-cpp-python is
imported only when this engine is built; without it the error says how to install it.

Model: `--model-path` is a .gguf file, or a folder holding one (an HF folder whose weights are only
safetensors is refused: convert it with llama.cpp's convert_hf_to_gguf.py). The GGUF's vocabulary
must cover the tokenizer's ids. `n_ctx` is `--context-length`, else the model's context length
(each context allocates a KV cache that long: lower it for big models).

Concurrency: a llama.cpp `Llama` object runs one sequence at a time and is not thread-safe, so the
engine keeps a pool of `n_parallel` contexts (default 1), each its own `Llama` (weights are
mmapped, so CPU memory for them is shared; each has its own KV cache) driven by its own thread.
Requests wait in FIFO order for a free context; when several are free, the one whose cached tokens
share the longest prefix with the prompt is taken. The thread decodes and samples, and hands
tokens to the request's async generator through a lock-protected list plus
`loop.call_soon_threadsafe` (tokens produced while the consumer is busy travel in one chunk), so
the event loop never blocks on llama.cpp. llama.cpp's ctypes calls release the GIL, so contexts
really run in parallel (each with `n_threads` threads; default: half the CPUs, split among them).

Prefix reuse: a context keeps its KV cache between requests. A new prompt re-uses the longest
common prefix with the tokens the context last evaluated (at least one prompt token is always
evaluated again, for fresh logits) and reports it as `cached_tokens`, as llama.cpp's own
`Llama.generate` and its server do; a follow-up turn of a conversation then only evaluates the new
turn. Outputs are the same with or without reuse (only rounding of the attention over the cached
part could differ, as with any prefix cache). `prefix_reuse: false` resets every context before
each request instead.

Sampling (SamplingOptions -> llama.cpp's sampler chain): temperature 0 or unset is greedy (the
chain is the penalties and `greedy`, exactly what `Llama.generate(temp=0)` builds); otherwise
top_k (unset/<=0: off), top_p, min_p, temperature, then a seeded `dist` (the request's seed, else
the `seed` option; 4294967295, the default, is a random seed). repetition_penalty,
presence_penalty and frequency_penalty are llama.cpp's penalties over the last
`last_n_tokens_size` (64) generated tokens; logit_bias is applied first. guided_json (so
response_format), guided_choice and guided_grammar become a GBNF grammar in the chain, and
log-probabilities are reported when asked (llamacpp_guided.py). The engine stops by itself at
max_tokens, at a stop token id, and at an eos id unless ignore_eos; until min_tokens are generated
those ids are banned from sampling (as vLLM does). The stop token is the last id of the final
chunk (the postprocessor hides it) and counts as generated.

Context limit: a prompt of n_ctx tokens or more is an InvalidArgument (HTTP 400, as vLLM does);
otherwise generation ends with "length" when prompt + output reaches n_ctx (the frontend already
rejects a max_tokens that does not fit, so this only guards direct callers).

Disaggregated prefill/decode (`kv_transfer`): as a prefill worker, `prefill` evaluates the prompt
and samples its first token exactly as `generate` would; unless the request ends there, it exports
the prompt's KV (the first token is not evaluated) as a `KvHandoff` (llamacpp_state.py: llama.cpp's
sequence state plus the prompt's ids, in a format naming the GGUF and llama-cpp-python's version).
As a decode worker, `generate_from_kv` loads that state into a free context in place of the
prompt's evaluation (the context's cached tokens become the prompt's, for prefix reuse later),
evaluates only what follows (the first token), and streams the rest as `generate` does;
`cached_tokens` is the handoff's size. A handoff for another model or prompt, or one llama.cpp
will not load (truncated, another KV layout, no room in the context) is a `KvImportError` before
any output, and the worker prefills locally. Greedy outputs equal the aggregated run's token for
token; penalties see the first token as generated, as they did on the prefill worker; a seeded
sampler starts afresh on the decode worker (as after migration), so sampled outputs differ from
an aggregated run's. `prompt_tokens_evaluated` counts the prompt tokens the contexts evaluated;
at debug level (DYN_LOG=info,dynamo_graph.engines.llamacpp=debug) each request logs how many
prompt tokens came from the cache or a handoff and how many were evaluated.

Cancellation: the thread checks `context.is_stopped()` (and `abort()`) before each token and
between prefill batches; the stream then ends with finish_reason "cancelled". Every final chunk
carries `completion_usage` (prompt, completion and cached tokens); the first chunk with tokens
carries `cached_tokens`.

Options (`--extra-engine-args` JSON, checked in llamacpp_args.py; an unknown key is an error
listing the known ones):
n_parallel, n_ctx (same as --context-length), n_threads, n_threads_batch, n_batch, n_ubatch,
n_gpu_layers, main_gpu, seed, use_mmap, use_mlock, flash_attn, offload_kqv, last_n_tokens_size,
rope_freq_base, rope_freq_scale, verbose, prefix_reuse. Errors in settings or the model are
`RunConfigError`s, so `dyngraph run` prints them like a bad flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig, KvImportError, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    TopLogprob,
)
from dynamo_graph.engines.llamacpp_args import (
    LlamaCppArgs,
    LlamaCppError,
    args_from_settings,
    find_gguf,
    import_llama_cpp,
)
from dynamo_graph.engines.llamacpp_guided import (
    CAPABILITIES,
    add_grammar,
    check_grammar,
    eog_ids,
    request_grammar,
    token_logprobs,
)
from dynamo_graph.engines.llamacpp_state import check_handoff, export_sequence, import_sequence, state_format
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.kv_transfer import KvHandoff
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

log = logging.getLogger(__name__)

DEFAULT_LAST_N = 64  # llama-cpp-python's last_n_tokens_size: the penalties' window
CLEANUP_WAIT_S = 30.0


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ---- one request, shared between the event loop and a context's thread ------------------------


class _Job:
    """A request's state: the thread appends tokens and finally sets `final` (or `error`); the
    event loop is woken at most once per batch of tokens it has not yet read."""

    __slots__ = (
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
        "prompt",
        "released",
        "sampling",
        "slot",
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
    ) -> None:
        self.context = context
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
        self.slot: _Slot | None = None
        self.released = False
        self.handoff = handoff  # the prompt's KV, computed elsewhere: load it instead of evaluating
        self.export = export  # a prefill: stop after the first token and export the prompt's KV
        self.exported: KvHandoff | None = None

    def stopped(self) -> bool:
        return self.cancelled or self.context.is_stopped()

    # -- thread side
    def emit(
        self,
        token: int | None = None,
        final: FinishReason | None = None,
        logprobs: tuple[float, list[TopLogprob]] | None = None,
    ) -> None:
        with self.lock:
            if token is not None:
                self.pending.append(token)
            if logprobs is not None:
                self.pending_logprobs.append(logprobs)
            if final is not None:
                self.final = final
            wake = not self.notified
            self.notified = True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self.wakeup.set)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                self.cancelled = True

    def fail(self, err: BaseException) -> None:
        self.error = err
        self.emit()

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


class _Slot:
    """One llama.cpp context (a `Llama`) and the thread that drives it."""

    def __init__(self, index: int, llm: Any) -> None:
        self.index = index
        self.llm = llm
        # One thread: jobs given to this context run strictly one after another.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"llamacpp-ctx{index}")
        self.futures: set[asyncio.Future[None]] = set()
        self.evaluated = 0  # prompt tokens this context evaluated (written by its thread only)

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        # Read from the event loop for idle contexts; their thread may still be winding down a
        # cancelled request, so this is only a hint for choosing among them.
        return _common_prefix(self.llm, prompt)


# ---- the engine --------------------------------------------------------------------------------


class LlamaCppEngine(LLMEngine):
    """A pool of llama.cpp contexts behind the engine contract; see the module docstring."""

    kv_transfer = True

    def __init__(
        self,
        gguf_path: str | Path,
        args: LlamaCppArgs | None = None,
        *,
        tokenizer_vocab_size: int | None = None,
        default_n_ctx: int | None = None,
    ) -> None:
        self.gguf_path = Path(gguf_path)
        self.args = args or LlamaCppArgs()
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.n_ctx = self.args.n_ctx or default_n_ctx or 0  # 0: llama.cpp takes the model's
        self.n_vocab = 0
        self.kv_format = ""  # set by start(): what this engine's KV handoffs are (llamacpp_state)
        self._llama_cpp: Any = None
        self._slots: list[_Slot] = []
        self._idle: list[_Slot] = []
        self._waiters: deque[asyncio.Future[_Slot]] = deque()
        self._jobs: dict[Context, _Job] = {}
        self._drained = asyncio.Event()
        self._drained.set()
        self._started = False
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> LlamaCppEngine:
        import_llama_cpp()  # say it is missing before anything else
        args = args_from_settings(cfg)
        if model is None:
            raise LlamaCppError(
                "out=llamacpp needs a model: pass --model-path FILE.gguf or a folder with one"
            )
        gguf_path = find_gguf(model)
        vocab = model.load_tokenizer().get_vocab_size(with_added_tokens=True)
        return cls(gguf_path, args, tokenizer_vocab_size=vocab, default_n_ctx=model.context_length)

    # ---- lifecycle -------------------------------------------------------------------------

    def config(self) -> EngineConfig:
        return EngineConfig(
            model_input="tokens",
            context_length=self.n_ctx,
            max_num_seqs=self.args.n_parallel,
            capabilities=list(CAPABILITIES),
        )

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the llamacpp engine was shut down")
        if self._started:
            return self.config()
        self._llama_cpp = import_llama_cpp()
        if not self.gguf_path.is_file():
            raise LlamaCppError(f"out=llamacpp: GGUF file {self.gguf_path} does not exist")
        for index in range(self.args.n_parallel):
            llm = await asyncio.to_thread(self._load)
            self._slots.append(_Slot(index, llm))  # appended at once: cleanup() closes it on failure
        first = self._slots[0].llm
        # llama.cpp may round the context up (to a multiple of 256): serve what was asked for.
        actual = first.n_ctx()
        self.n_ctx = min(self.n_ctx, actual) if self.n_ctx else actual
        self.n_vocab = first.n_vocab()
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size > self.n_vocab:
            raise LlamaCppError(
                f"{self.gguf_path.name}: the GGUF's vocabulary has {self.n_vocab} tokens but the "
                f"tokenizer has {self.tokenizer_vocab_size}: they belong to different models "
                "(check --model-config, or the tokenizer.json beside the GGUF)"
            )
        version = self._llama_cpp.__version__
        self.kv_format = await asyncio.to_thread(state_format, self.gguf_path, version)
        self._idle = list(self._slots)
        self._started = True
        log.info(
            "%s loaded, %d context%s of %d tokens",
            self.gguf_path.name,
            len(self._slots),
            "s" if len(self._slots) > 1 else "",
            self.n_ctx,
        )
        return self.config()

    def _load(self) -> Any:
        kwargs: dict[str, Any] = {"verbose": False, "seed": self.args.seed}
        threads = max(1, _available_cpus() // 2 // self.args.n_parallel)
        kwargs["n_threads"] = threads
        kwargs.update(self.args.llama_kwargs)
        kwargs.setdefault("n_threads_batch", kwargs["n_threads"])
        try:
            return self._llama_cpp.Llama(model_path=str(self.gguf_path), n_ctx=self.n_ctx, **kwargs)
        except (ValueError, RuntimeError, OSError) as err:
            raise LlamaCppError(f"llama.cpp could not load {self.gguf_path}: {err}") from None

    @property
    def prompt_tokens_evaluated(self) -> int:
        """Prompt tokens the contexts evaluated (not taken from their cache or a handoff)."""
        return sum(slot.evaluated for slot in self._slots)

    async def drain(self) -> None:
        while self._jobs or self._waiters:
            self._drained.clear()
            await self._drained.wait()

    async def abort(self, context: Context) -> None:
        job = self._jobs.get(context)
        if job is not None:
            job.cancelled = True

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        for job in self._jobs.values():
            job.cancelled = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(EngineShutdown("the llamacpp engine shut down"))
        running = [f for s in self._slots for f in s.futures if not f.done()]
        if running:
            await asyncio.wait(running, timeout=CLEANUP_WAIT_S)
        for slot in self._slots:
            if any(not f.done() for f in slot.futures):
                log.warning("llamacpp: context %d did not stop within %.0fs", slot.index, CLEANUP_WAIT_S)
                continue  # closing a Llama its thread still uses would crash the process
            slot.executor.shutdown(wait=False)
            with contextlib.suppress(Exception):
                slot.llm.close()
        self._idle.clear()

    # ---- requests --------------------------------------------------------------------------

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        async for out in self._stream(self._job(request, context)):
            yield out

    async def prefill(
        self, request: PreprocessedRequest, context: Context
    ) -> tuple[LLMEngineOutput, KvHandoff | None]:
        """Evaluate the prompt and sample its first token as `generate` does; unless the request
        ends there, export the prompt's KV (the first token is not evaluated: the decode worker
        does that) and return the token's chunk, unfinished, with it."""
        job = self._job(request, context, export=True)
        answer = LLMEngineOutput()
        async for out in self._stream(job):
            answer.token_ids.extend(out.token_ids)
            if out.cached_tokens is not None:
                answer.cached_tokens = out.cached_tokens
            answer.finish_reason, answer.completion_usage = out.finish_reason, out.completion_usage
        if job.exported is not None:
            answer.finish_reason = answer.completion_usage = None
        return answer, job.exported

    async def generate_from_kv(  # type: ignore[override]
        self, request: PreprocessedRequest, handoff: KvHandoff, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Load the handoff into a free context instead of evaluating its tokens, evaluate the
        rest of the prompt (the prefill's first token), then go on as `generate`. KvImportError,
        before any output, when the handoff is not for this model and prompt or will not load."""
        job = self._job(request, context, handoff=handoff)
        check_handoff(handoff, self.kv_format, job.prompt)
        async for out in self._stream(job):
            yield out

    async def _stream(self, job: _Job) -> AsyncIterator[LLMEngineOutput]:
        """Run `job` on a free context and stream its tokens as they come."""
        context = job.context
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=job.usage())
            return
        self._jobs[context] = job
        self._drained.clear()
        first = True
        try:
            slot = await self._acquire(job)
            if slot is None:  # stopped while waiting for a context
                yield LLMEngineOutput(finish_reason="cancelled", completion_usage=job.usage())
                return
            self._run(slot, job)
            while True:
                await job.wakeup.wait()
                tokens, logprobs, final = job.take()
                if job.error is not None:
                    self._release_job(job)
                    raise job.error
                if not tokens and final is None:
                    continue
                out = LLMEngineOutput(token_ids=tokens)
                if job.logprobs is not None and tokens:
                    out.log_probs = [lp for lp, _ in logprobs]
                    out.top_logprobs = [top for _, top in logprobs]
                if first and tokens:
                    out.cached_tokens = job.cached
                    first = False
                if final is not None:
                    # The context is free for the next request now: its thread has nothing left
                    # to do for this one, and anything queued on it runs after it anyway.
                    self._release_job(job)
                    out.finish_reason = final
                    out.completion_usage = job.usage()
                    yield out
                    return
                yield out
        finally:
            job.cancelled = True  # a no-op once finished; stops the thread if our consumer left
            self._release_job(job)
            if self._jobs.get(context) is job:
                del self._jobs[context]
            self._check_drained()

    def _job(
        self,
        request: PreprocessedRequest | AnyRequest,
        context: Context,
        *,
        export: bool = False,
        handoff: KvHandoff | None = None,
    ) -> _Job:
        if not isinstance(request, PreprocessedRequest):
            raise InvalidArgument(
                "the llamacpp engine takes pre-processed requests (token ids)", param="model"
            )
        if self._closed:
            raise EngineShutdown("the llamacpp engine shut down")
        if not self._started:
            raise EngineError("the llamacpp engine is not started")
        prompt = list(request.token_ids)
        n = len(prompt)
        if n == 0:
            raise InvalidArgument("the prompt is empty: at least one token is needed", param="prompt")
        vocab = self.n_vocab
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:  # llama.cpp aborts the whole process on an out-of-range id
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="token_ids"
            )
        if n >= self.n_ctx:
            raise InvalidArgument(
                f"This model's maximum context length is {self.n_ctx} tokens. However, the prompt has "
                f"{n} tokens, leaving no room for the completion. Please reduce the length of the prompt.",
                param="prompt",
            )
        sc = request.stop_conditions
        if sc.max_tokens is not None and sc.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, not {sc.max_tokens}", param="max_tokens")
        if sc.min_tokens is not None and sc.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be at least 0, not {sc.min_tokens}", param="min_tokens")
        so = request.sampling_options
        grammar = request_grammar(so)
        end_ids: frozenset[int] = frozenset()
        if grammar is not None:
            model = self._slots[0].llm._model
            check_grammar(self._llama_cpp, model, grammar)
            end_ids = eog_ids(self._llama_cpp, model)
        if (so.n or 1) > 1 or (so.best_of or 1) > 1:
            raise InvalidArgument("n > 1 / best_of > 1 is not supported by out=llamacpp", param="n")
        for key in so.logit_bias or {}:
            if not (key.lstrip("-").isdigit() and 0 <= int(key) < vocab):
                raise InvalidArgument(
                    f"logit_bias key {key!r} is not a token id in this model's vocabulary [0, {vocab})",
                    param="logit_bias",
                )
        room = self.n_ctx - n
        stop_ids = set(sc.stop_token_ids or ())
        if not sc.ignore_eos:
            stop_ids.update(request.eos_token_ids)
            stop_ids.update(sc.stop_token_ids_hidden or ())
        return _Job(
            context,
            prompt,
            max_tokens=room if sc.max_tokens is None else min(sc.max_tokens, room),
            min_tokens=sc.min_tokens or 0,
            stop_ids=frozenset(stop_ids),
            sampling=so,
            loop=asyncio.get_running_loop(),
            handoff=handoff,
            export=export,
            grammar=grammar,
            logprobs=request.output_options.logprobs,
            end_ids=end_ids,
        )

    # ---- the pool of contexts ----------------------------------------------------------------

    async def _acquire(self, job: _Job) -> _Slot | None:
        """A free context for `job` (FIFO among waiters); None if the request stopped meanwhile."""
        if self._idle and not self._waiters:
            best = max(self._idle, key=lambda s: s.cached_prefix(job.prompt)) if len(self._idle) > 1 else None
            slot = best or self._idle[0]
            self._idle.remove(slot)
            return slot
        waiter: asyncio.Future[_Slot] = job.loop.create_future()
        self._waiters.append(waiter)
        stop = asyncio.ensure_future(job.context.stopped())
        try:
            await asyncio.wait((waiter, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not waiter.done():
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            elif not waiter.cancelled() and waiter.exception() is None and job.stopped():
                self._release(waiter.result())  # handed a context just as we stopped: pass it on
                return None
        if waiter.cancelled():
            return None
        return waiter.result()  # raises EngineShutdown when cleanup() failed the waiters

    def _release_job(self, job: _Job) -> None:
        """Give the job's context back, once. Safe while its thread still runs the job: the
        context's single thread runs the next job only after this one stopped."""
        if job.slot is not None and not job.released:
            job.released = True
            self._release(job.slot)

    def _release(self, slot: _Slot) -> None:
        if self._closed:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._idle.append(slot)
        self._check_drained()

    def _check_drained(self) -> None:
        if not self._jobs and not self._waiters:
            self._drained.set()

    def _run(self, slot: _Slot, job: _Job) -> None:
        job.slot = slot
        future = job.loop.run_in_executor(slot.executor, self._decode, slot, job)
        slot.futures.add(future)
        future.add_done_callback(lambda f: self._finished(slot, job, f))

    def _finished(self, slot: _Slot, job: _Job, future: asyncio.Future[None]) -> None:
        slot.futures.discard(future)
        if not future.cancelled() and future.exception() is not None:  # _decode reports its own
            log.error("llamacpp: context %d failed: %s", slot.index, future.exception())
        self._release_job(job)

    # ---- the decode loop (runs in the context's thread) --------------------------------------

    def _decode(self, slot: _Slot, job: _Job) -> None:
        llm = slot.llm
        try:
            token, final, logprobs = self._generate(slot, job)
            if final is None:  # a prefill, not finished at its first token: it goes on elsewhere
                job.exported = export_sequence(self._llama_cpp, llm.ctx, self.kv_format, job.prompt)
                final = "length"
            job.emit(token, final, logprobs)
        except KvImportError as err:
            llm.n_tokens = 0  # sequence 0 may hold part of the state: reuse nothing of it
            job.fail(err)
        except BaseException as err:
            llm.n_tokens = 0  # its KV cache may hold half a batch: reuse nothing of it
            log.exception("llamacpp: decoding failed")
            job.fail(EngineError(f"llama.cpp failed: {err}"))

    def _cached_prompt(self, llm: Any, job: _Job) -> int:
        """Put the KV of the prompt's start in place — a handoff's, or what the context still
        holds of an earlier request — and return how many tokens it covers."""
        prompt = job.prompt
        if job.handoff is not None:
            import_sequence(self._llama_cpp, llm.ctx, job.handoff)
            reuse = job.handoff.num_tokens
            llm.input_ids[:reuse] = prompt[:reuse]
        else:
            reuse = 0
            recurrent = getattr(llm, "_is_recurrent", False) or getattr(llm, "_is_hybrid", False)
            if self.args.prefix_reuse and not recurrent:
                # At least the last prompt token is evaluated again, so its logits are fresh.
                reuse = min(_common_prefix(llm, prompt), len(prompt) - 1)
            if reuse == 0:
                llm.reset()
        llm.n_tokens = reuse  # eval() drops the KV cache past n_tokens first
        return reuse

    def _generate(
        self, slot: _Slot, job: _Job
    ) -> tuple[int | None, FinishReason | None, tuple[float, list[TopLogprob]] | None]:
        """Prefill, then sample until a stop; returns the last token (sent with the finish
        reason, in one chunk), the finish reason — None for a prefill (`job.export`) whose first
        token did not end the request — and the last token's log-probabilities."""
        llm = slot.llm
        prompt = job.prompt
        job.cached = reuse = self._cached_prompt(llm, job)
        n_batch = llm.n_batch
        for i in range(reuse, len(prompt), n_batch):
            if job.stopped():
                return None, "cancelled", None
            llm.eval(prompt[i : i + n_batch])
            slot.evaluated += min(n_batch, len(prompt) - i)
        log.debug(
            "request %s: %d prompt tokens, %d from %s, %d evaluated",
            job.context.id,
            len(prompt),
            reuse,
            "a KV handoff" if job.handoff is not None else "the context's cache",
            len(prompt) - reuse,
        )
        sample, accept, samplers = self._samplers(llm, job)
        try:
            if job.handoff is not None:
                # The prefill's first token (and any after the handoff) were generated, not given:
                # the penalties count them, as they did on the prefill worker.
                for token in prompt[job.handoff.num_tokens :]:
                    for chain in samplers:
                        accept(chain.sampler, token)
            ctx = llm.ctx
            while True:
                if job.stopped():
                    return None, "cancelled", None
                banning = job.generated < job.min_tokens and len(samplers) > 1
                chain = samplers[1] if banning else samplers[0]
                token = sample(chain.sampler, ctx, -1)  # also accepts it into that chain
                for other in samplers:
                    if other is not chain:  # keep the penalties' history the same in both
                        accept(other.sampler, token)
                if token in job.end_ids and token not in job.stop_ids:
                    return None, "stop", None  # the grammar is complete: end-of-generation only
                job.generated += 1
                logprobs = None
                if job.logprobs is not None:
                    logprobs = token_logprobs(self._llama_cpp, llm, token, job.logprobs)
                if token in job.stop_ids and job.generated > job.min_tokens:
                    return token, "stop", logprobs
                if job.generated >= job.max_tokens:
                    return token, "length", logprobs
                if job.export:
                    return token, None, logprobs
                job.emit(token, logprobs=logprobs)
                llm.eval([token])
        finally:
            for chain in samplers:
                chain.close()

    def _samplers(self, llm: Any, job: _Job) -> tuple[Any, Any, list[Any]]:
        """llama.cpp sampler chains for the request: [normal] or [normal, with stop ids banned]
        (the latter while min_tokens are not yet generated)."""
        from llama_cpp._internals import LlamaSampler

        lc = self._llama_cpp
        so = job.sampling
        bias = {int(k): float(v) for k, v in (so.logit_bias or {}).items()}
        banned = job.stop_ids if job.min_tokens > 0 else frozenset()
        chains = []
        for ban in (False, True) if banned else (False,):
            chain = LlamaSampler()
            chain_bias = {**bias, **{t: float("-inf") for t in banned}} if ban else bias
            if chain_bias:
                chain.add_logit_bias(llm.n_vocab(), chain_bias)
            if job.grammar is not None:
                add_grammar(lc, chain, llm._model, job.grammar)
            chain.add_penalties(
                n_vocab=llm.n_vocab(),
                penalty_last_n=self.args.llama_kwargs.get("last_n_tokens_size", DEFAULT_LAST_N),
                penalty_repeat=1.0 if so.repetition_penalty is None else so.repetition_penalty,
                penalty_freq=so.frequency_penalty or 0.0,
                penalty_present=so.presence_penalty or 0.0,
            )
            if not so.temperature:  # 0 or unset: greedy
                chain.add_greedy()
            else:
                if so.top_k is not None and so.top_k > 0:
                    chain.add_top_k(so.top_k)
                if so.top_p is not None and so.top_p < 1.0:
                    chain.add_top_p(so.top_p, 1)
                if so.min_p:
                    chain.add_min_p(so.min_p, 1)
                chain.add_temp(so.temperature)
                chain.add_dist(self.args.seed if so.seed is None else so.seed & 0xFFFFFFFF)
            chains.append(chain)
        return lc.llama_sampler_sample, lc.llama_sampler_accept, chains


def _common_prefix(llm: Any, prompt: Sequence[int]) -> int:
    n = min(llm.n_tokens, len(prompt))
    if n == 0:
        return 0
    cached = llm.input_ids[:n].tolist()
    i = 0
    while i < n and cached[i] == prompt[i]:
        i += 1
    return i
