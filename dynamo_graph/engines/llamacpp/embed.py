"""`out=llamacpp --embedding`: the embedding mode of a GGUF model, run by llama-cpp-python.

The model is loaded as llama-cpp-python's own `Llama(embedding=True)` and inputs are embedded
exactly as its `Llama.embed()` does — the same batches of whole sequences (up to `n_batch` tokens
and `n_seq_max` sequences per `llama_decode`), the same pooled read-back — but from the token ids
the frontend sends, since `embed()` only takes text. Vectors are pooled as the model says (the
GGUF's `pooling_type`); a model that names none (a plain decoder LLM) needs `pooling` in
`--extra-engine-args` (`mean`, `cls`, `last`), and gets a clear error at start without it.
Vectors come back unit-length, as OpenAI's do; `dimensions` is refused (a GGUF does not say its
vectors may be shortened).

Options: `pooling` plus llamacpp's own (args.py) that apply to one context: n_ctx (or
--context-length), n_threads, n_threads_batch, n_gpu_layers, main_gpu, use_mmap, use_mlock,
flash_attn, offload_kqv, rope_freq_base, rope_freq_scale, verbose. `n_batch`/`n_ubatch` default
to n_ctx, so an input as long as the context is embedded in one pass (pooling needs the whole
sequence in one batch). One request is computed at a time, in a worker thread.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.embedding import (
    EMBEDDING_MODEL_TYPE,
    EmbeddingEngine,
    check_embedding_request,
    unit_vector,
)
from dynamo_graph.backend.engine import EngineConfig
from dynamo_graph.backend.errors import EngineShutdown
from dynamo_graph.engines.llamacpp.args import (
    SOURCE,
    LlamaCppArgs,
    LlamaCppError,
    find_gguf,
    import_llama_cpp,
)
from dynamo_graph.llm.protocol import EmbeddingOutput, PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

POOLING = ("mean", "cls", "last")
# Options of the generating engine that mean nothing for one embedding context.
_NOT_HERE = ("n_parallel", "prefix_reuse", "seed", "last_n_tokens_size")


class LlamaCppEmbeddingEngine(EmbeddingEngine):
    """A GGUF model's embeddings; see the module docstring."""

    def __init__(
        self, gguf_path: str | Path, args: LlamaCppArgs | None = None, *, pooling: str | None = None
    ) -> None:
        self.gguf_path = Path(gguf_path)
        self.args = args or LlamaCppArgs()
        self.pooling = pooling
        self.n_ctx = 0
        self.n_vocab = 0
        self._llama: Any = None
        self._lock = asyncio.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> LlamaCppEmbeddingEngine:
        import_llama_cpp()
        if model is None:
            raise LlamaCppError(
                "out=llamacpp needs a model: pass --model-path FILE.gguf or a folder with one"
            )
        data = dict(cfg.engine_args())
        pooling = data.pop("pooling", None)
        if pooling is not None and pooling not in POOLING:
            raise LlamaCppError(f"{SOURCE}: pooling must be one of {', '.join(POOLING)}, not {pooling!r}")
        ignored = [key for key in _NOT_HERE if key in data]
        if ignored:
            raise LlamaCppError(f"{SOURCE}: {', '.join(ignored)} do not apply to an embedding worker")
        if cfg.context_length is not None:
            if data.get("n_ctx", cfg.context_length) != cfg.context_length:
                raise LlamaCppError(
                    f"--context-length {cfg.context_length} conflicts with n_ctx={data['n_ctx']!r} in "
                    f"{SOURCE}; give one of them"
                )
            data["n_ctx"] = cfg.context_length
        args = LlamaCppArgs.from_dict(data)
        if args.n_ctx is None and model.context_length:
            args = LlamaCppArgs(n_ctx=model.context_length, llama_kwargs=args.llama_kwargs)
        return cls(find_gguf(model), args, pooling=pooling)

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the llamacpp embedding engine was shut down")
        if self._llama is None:
            self._llama = await asyncio.to_thread(self._load)
            self.n_ctx = self._llama.n_ctx()
            self.n_vocab = self._llama.n_vocab()
        return EngineConfig(
            model_input="tokens", context_length=self.n_ctx, model_type=list(EMBEDDING_MODEL_TYPE)
        )

    def _load(self) -> Any:
        lc = import_llama_cpp()
        kw = dict(self.args.llama_kwargs)
        n_ctx = self.args.n_ctx or 0
        pooling = {"mean": lc.LLAMA_POOLING_TYPE_MEAN, "cls": lc.LLAMA_POOLING_TYPE_CLS}
        pooling["last"] = lc.LLAMA_POOLING_TYPE_LAST
        if not self.gguf_path.is_file():
            raise LlamaCppError(f"out=llamacpp: GGUF file {self.gguf_path} does not exist")
        try:
            llama = lc.Llama(
                model_path=str(self.gguf_path),
                embedding=True,
                n_ctx=n_ctx,
                n_batch=kw.pop("n_batch", n_ctx or 512),
                n_ubatch=kw.pop("n_ubatch", n_ctx or 512),
                pooling_type=pooling.get(self.pooling or "", lc.LLAMA_POOLING_TYPE_UNSPECIFIED),
                verbose=kw.pop("verbose", False),
                **kw,
            )
        except (ValueError, RuntimeError, OSError) as err:
            raise LlamaCppError(f"llama.cpp could not load {self.gguf_path}: {err}") from None
        if llama.pooling_type() == lc.LLAMA_POOLING_TYPE_NONE:
            llama.close()
            raise LlamaCppError(
                f"{self.gguf_path.name} names no pooling for its embeddings (a generative model): set "
                f'"pooling" ({", ".join(POOLING)}) in {SOURCE}'
            )
        return llama

    async def embed(self, request: PreprocessedEmbeddingRequest, context: Context) -> EmbeddingOutput:
        if self._closed or self._llama is None:
            raise EngineShutdown("the llamacpp embedding engine is not running")
        check_embedding_request(request, self.n_vocab, self.n_ctx)
        async with self._lock:
            vectors = await asyncio.to_thread(self._embed, request.token_ids)
        tokens = sum(len(ids) for ids in request.token_ids)
        return EmbeddingOutput(embeddings=[unit_vector(v) for v in vectors], prompt_tokens=tokens)

    def _embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """`Llama.embed()`'s loop over token ids: whole sequences batched up to n_batch tokens
        and n_seq_max sequences, each batch decoded from an empty cache, pooled per sequence."""
        lc = import_llama_cpp()
        llama = self._llama
        n_embd, n_batch = llama.n_embd(), llama.n_batch
        n_seq_max = llama.context_params.n_seq_max
        ctx, batch = llama._ctx, llama._batch  # the context and batch embed() itself drives
        out: list[list[float]] = []
        sizes: list[int] = []

        def decode() -> None:
            ctx.kv_cache_clear()
            ctx.decode(batch)
            batch.reset()
            for seq in range(len(sizes)):
                out.append(list(lc.llama_get_embeddings_seq(ctx.ctx, seq)[:n_embd]))

        batch.reset()
        tokens_in_batch = 0
        for ids in inputs:
            if sizes and (tokens_in_batch + len(ids) > n_batch or len(sizes) >= n_seq_max):
                decode()
                sizes, tokens_in_batch = [], 0
            batch.add_sequence(ids, len(sizes), True)
            sizes.append(len(ids))
            tokens_in_batch += len(ids)
        decode()
        ctx.kv_cache_clear()
        return out

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._llama is not None:
            async with self._lock:
                self._llama.close()
