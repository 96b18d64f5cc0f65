"""`out=llamacpp`: a GGUF model run in-process by llama.cpp (llama-cpp-python), token ids in and
out. The user's manual (model, concurrency, the unified KV cache, prefix reuse, determinism,
sampling, the context limit, prefill/decode, LoRA, options) is docs/engines/llamacpp.md.

Contract: one llama.cpp context of `n_parallel` sequences decoded together by one thread
(batch.py), which hands tokens to each request's generator without blocking the event loop; a
sequence keeps its KV cells after its request, for prefix reuse (reported as `cached_tokens`).
Stop and eos ids end a sequence here (banned until min_tokens); the prompt must leave room in
`n_ctx` (else `InvalidArgument`). Cancellation is checked before each step. Settings and model
errors are `RunConfigError`s (args.py); llama-cpp-python is imported when an engine is built.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest, request_priority
from dynamo_graph.engines.llamacpp.args import (
    LlamaCppArgs,
    LlamaCppError,
    args_from_settings,
    context_params,
    find_gguf,
    import_llama_cpp,
    model_params,
)
from dynamo_graph.engines.llamacpp.batch import BatchLoop, Job
from dynamo_graph.engines.llamacpp.guided import (
    CAPABILITIES,
    add_grammar,
    check_grammar,
    eog_ids,
    request_grammar,
)
from dynamo_graph.engines.llamacpp.state import check_handoff, state_format
from dynamo_graph.engines.sampling import capped_max_tokens, refuse_several_choices, stop_token_ids
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.kv_transfer import KvHandoff
    from dynamo_graph.backend.lora import LoraAdapter
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

log = logging.getLogger(__name__)

DEFAULT_LAST_N = 64  # llama-cpp-python's last_n_tokens_size: the penalties' window
CLEANUP_WAIT_S = 30.0


class LlamaCppEngine(LLMEngine):
    """One llama.cpp context serving requests as its sequences; see docs/engines/llamacpp.md."""

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
        self.n_ctx = self.args.n_ctx or default_n_ctx or 0  # per sequence; 0: the model's
        self.n_vocab = 0
        self.kv_format = ""  # set by start(): what this engine's KV handoffs are (state.py)
        self._llama_cpp: Any = None
        self._model: Any = None  # llama-cpp-python's LlamaModel / LlamaContext wrappers
        self._context: Any = None
        self._loop: BatchLoop | None = None
        self._jobs: dict[Context, Job] = {}
        self._drained = asyncio.Event()
        self._drained.set()
        self._started = False
        self._closed = False
        self._adapters: dict[str, Any] = {}  # LoRA adapter name -> its llama_adapter_lora_p

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
        lc = self._llama_cpp = import_llama_cpp()
        if not self.gguf_path.is_file():
            raise LlamaCppError(f"out=llamacpp: GGUF file {self.gguf_path} does not exist")
        await asyncio.to_thread(self._load)
        self.n_vocab = self._model.n_vocab()
        if self.tokenizer_vocab_size is not None and self.tokenizer_vocab_size > self.n_vocab:
            raise LlamaCppError(
                f"{self.gguf_path.name}: the GGUF's vocabulary has {self.n_vocab} tokens but the "
                f"tokenizer has {self.tokenizer_vocab_size}: they belong to different models "
                "(check --model-config, or the tokenizer.json beside the GGUF)"
            )
        self.kv_format = await asyncio.to_thread(state_format, self.gguf_path, lc.__version__)
        model, ctx = self._model.model, self._context.ctx
        self._loop = BatchLoop(
            lc,
            ctx,
            n_seq=self.args.n_parallel,
            n_batch=lc.llama_n_batch(ctx),
            recurrent=lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model),
            prefix_reuse=self.args.prefix_reuse,
            kv_format=self.kv_format,
            n_vocab=self.n_vocab,
            samplers=self._samplers,
        )
        self._started = True
        log.info(
            "%s loaded, one context of %d sequence%s of %d tokens",
            self.gguf_path.name,
            self.args.n_parallel,
            "s" if self.args.n_parallel > 1 else "",
            self.n_ctx,
        )
        return self.config()

    def _load(self) -> None:
        """The model once, and its one context (in a thread: loading takes a while)."""
        from llama_cpp._internals import LlamaContext, LlamaModel
        from llama_cpp._logger import set_verbose
        from llama_cpp._utils import suppress_stdout_stderr

        lc = self._llama_cpp
        verbose = self.args.llama_kwargs.get("verbose", False)
        set_verbose(verbose)
        lc.llama_backend_init()
        try:
            self._model = LlamaModel(
                path_model=str(self.gguf_path), params=model_params(lc, self.args), verbose=verbose
            )
            self.n_ctx = self.n_ctx or self._model.n_ctx_train()
            params = context_params(lc, self.args, self.n_ctx)
            # Quiet unless verbose, as the model's load is: with a unified cache llama.cpp warns
            # that the context (all sequences' cells) exceeds the model's training context,
            # although no sequence may hold more than n_ctx positions.
            with suppress_stdout_stderr(disable=verbose):
                self._context = LlamaContext(model=self._model, params=params, verbose=verbose)
        except (ValueError, RuntimeError, OSError) as err:
            raise LlamaCppError(f"llama.cpp could not load {self.gguf_path}: {err}") from None

    @property
    def prompt_tokens_evaluated(self) -> int:
        """Prompt tokens the context evaluated (not taken from its cache or a handoff)."""
        return self._loop.evaluated if self._loop is not None else 0

    @property
    def decode_steps(self) -> int:
        """llama_decode calls so far: one per step, for all the sequences running in it."""
        return self._loop.steps if self._loop is not None else 0

    def metrics_collectors(self) -> Sequence[Collector]:
        return (LlamaCppCollector(self),)

    async def drain(self) -> None:
        while self._jobs:
            self._drained.clear()
            await self._drained.wait()

    async def load_lora(self, adapter: LoraAdapter) -> None:
        """A GGUF LoRA (`convert_lora_to_gguf.py`'s output, made for this model): the file, or a
        folder holding one .gguf. llama.cpp frees adapters with the model."""
        if not self._started:
            raise EngineError("the llamacpp engine is not started")
        path, loaded = await asyncio.to_thread(self._init_adapter, Path(adapter.path))
        if not loaded:
            raise InvalidArgument(
                f"llama.cpp could not load {path} as a LoRA adapter of {self.gguf_path.name} (a GGUF "
                "LoRA made for this model, e.g. by llama.cpp's convert_lora_to_gguf.py)",
                param="lora_path",
            )
        self._adapters[adapter.name] = loaded

    def _init_adapter(self, path: Path) -> tuple[Path, Any]:
        if path.is_dir():
            found = sorted(path.glob("*.gguf"))
            if len(found) != 1:
                message = f"lora_path {path} holds {len(found)} .gguf files; name the adapter's file"
                raise InvalidArgument(message, param="lora_path")
            path = found[0]
        return path, self._llama_cpp.llama_adapter_lora_init(self._model.model, str(path).encode())

    async def unload_lora(self, name: str) -> None:
        # Requests running with it finish with it; its memory goes with the model.
        self._adapters.pop(name, None)

    async def abort(self, context: Context) -> None:
        job = self._jobs.get(context)
        if job is not None:
            job.cancelled = True

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The thread ends running requests ("cancelled") and fails waiting ones (EngineShutdown).
        if self._loop is not None and not await asyncio.to_thread(self._loop.close, CLEANUP_WAIT_S):
            log.warning("llamacpp: the decoding thread did not stop within %.0fs", CLEANUP_WAIT_S)
            return  # freeing a context its thread still uses would crash the process
        if self._context is not None:
            self._context.close()
        if self._model is not None:
            self._model.close()

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
        """Load the handoff into a free sequence instead of evaluating its tokens, evaluate the
        rest of the prompt (the prefill's first token), then go on as `generate`. KvImportError,
        before any output, when the handoff is not for this model and prompt or will not load."""
        job = self._job(request, context, handoff=handoff)
        check_handoff(handoff, self.kv_format, job.prompt)
        async for out in self._stream(job):
            yield out

    async def _stream(self, job: Job) -> AsyncIterator[LLMEngineOutput]:
        """Hand `job` to the decoding thread and stream its tokens as they come."""
        context = job.context
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=job.usage())
            return
        assert self._loop is not None  # _job() checked that the engine runs
        self._loop.submit(job)
        self._jobs[context] = job
        self._drained.clear()
        first = True
        try:
            while True:
                await job.wakeup.wait()
                tokens, logprobs, final = job.take()
                if job.error is not None:
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
                    out.finish_reason = final
                    out.completion_usage = job.usage()
                    yield out
                    return
                yield out
        finally:
            job.cancelled = True  # a no-op once finished; ends the sequence if our consumer left
            if self._jobs.get(context) is job:
                del self._jobs[context]
            if not self._jobs:
                self._drained.set()

    def _job(
        self,
        request: PreprocessedRequest | AnyRequest,
        context: Context,
        *,
        export: bool = False,
        handoff: KvHandoff | None = None,
    ) -> Job:
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
            check_grammar(self._llama_cpp, self._model, grammar)
            end_ids = eog_ids(self._llama_cpp, self._model)
        refuse_several_choices(request, "llamacpp")
        for key in so.logit_bias or {}:
            if not (key.lstrip("-").isdigit() and 0 <= int(key) < vocab):
                raise InvalidArgument(
                    f"logit_bias key {key!r} is not a token id in this model's vocabulary [0, {vocab})",
                    param="logit_bias",
                )
        return Job(
            context,
            prompt,
            max_tokens=capped_max_tokens(request, self.n_ctx),
            min_tokens=sc.min_tokens or 0,
            stop_ids=frozenset(stop_token_ids(request)),
            sampling=so,
            loop=asyncio.get_running_loop(),
            handoff=handoff,
            export=export,
            grammar=grammar,
            logprobs=request.output_options.logprobs,
            end_ids=end_ids,
            adapter=self._adapters.get(request.model),
            priority=request_priority(request),
        )

    def _samplers(self, job: Job) -> list[Any]:
        """llama.cpp sampler chains for the request: [normal] or [normal, with stop ids banned]
        (the latter while min_tokens are not yet generated). Called by the decoding thread."""
        from llama_cpp._internals import LlamaSampler

        so = job.sampling
        n_vocab = self.n_vocab
        bias = {int(k): float(v) for k, v in (so.logit_bias or {}).items()}
        banned = job.stop_ids if job.min_tokens > 0 else frozenset()
        chains = []
        for ban in (False, True) if banned else (False,):
            chain = LlamaSampler()
            chain_bias = {**bias, **{t: float("-inf") for t in banned}} if ban else bias
            if chain_bias:
                chain.add_logit_bias(n_vocab, chain_bias)
            if job.grammar is not None:
                add_grammar(self._llama_cpp, chain, self._model, job.grammar)
            chain.add_penalties(
                n_vocab=n_vocab,
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
        return chains


class LlamaCppCollector(Collector):
    """llama-cpp-python exposes no Prometheus series (llama.cpp's C++ server does, not the
    bindings), so the worker's /metrics gets what this engine counts itself."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        requests = GaugeMetricFamily(
            "dyngraph_llamacpp_requests", "Requests in the engine (running or waiting)"
        )
        requests.add_metric([], len(engine._jobs))
        slots = GaugeMetricFamily("dyngraph_llamacpp_max_sequences", "Sequences the context runs at once")
        slots.add_metric([], engine.args.n_parallel)
        evaluated = CounterMetricFamily(
            "dyngraph_llamacpp_prompt_tokens_evaluated", "Prompt tokens evaluated (not from a cache)"
        )
        evaluated.add_metric([], engine.prompt_tokens_evaluated)
        steps = CounterMetricFamily("dyngraph_llamacpp_decode_steps", "llama_decode calls")
        steps.add_metric([], engine.decode_steps)
        yield from (requests, slots, evaluated, steps)
