"""`out=vllm --embedding`: vLLM's pooling runner behind the embedding engine contract.

The same `AsyncLLM` as `out=vllm` (engine.py: install, flags, `--extra-engine-args`, environment),
started with `runner="pooling"` and, for a model that is not an embedding model by architecture,
`convert="embed"` (both may be given in `--extra-engine-args` instead). Each input is one
`AsyncLLM.encode(TokensPrompt(prompt_token_ids=...), PoolingParams(task="embed"))` request, all of
a request's inputs in flight together so vLLM batches them; vectors come back pooled and
normalized as the model's pooler config says (vLLM's defaults), and unit-length. `dimensions`
goes to vLLM (Matryoshka models only: the card advertises it when `ModelConfig.is_matryoshka`).
A cancelled request is aborted inside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.embedding import (
    DIMENSIONS_CAPABILITY,
    EMBEDDING_MODEL_TYPE,
    EmbeddingEngine,
    check_embedding_request,
    unit_vector,
)
from dynamo_graph.backend.engine import EngineConfig
from dynamo_graph.backend.errors import EngineShutdown, InvalidArgument
from dynamo_graph.engines.vllm.args import (
    VllmError,
    check_engine_args,
    engine_args_from_settings,
    import_vllm,
)
from dynamo_graph.llm.protocol import EmbeddingOutput, PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel


class VllmEmbeddingEngine(EmbeddingEngine):
    """vLLM's pooling runner; see the module docstring."""

    def __init__(self, engine_args: Mapping[str, Any]) -> None:
        self.engine_args = {"runner": "pooling", "convert": "embed", **engine_args}
        self._llm: Any = None
        self._vllm: dict[str, Any] = {}
        self._client_errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
        self._ids = itertools.count(1)
        self.context_length = 0
        self.vocab_size = 0
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> VllmEmbeddingEngine:
        kwargs = engine_args_from_settings(cfg, model)
        if "enable_prefix_caching" not in cfg.engine_args():
            del kwargs["enable_prefix_caching"]  # generation's default; pooling leaves it to vLLM
        return cls(kwargs)

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the vllm embedding engine was shut down")
        if self._llm is None:
            await asyncio.to_thread(self._import)
            args_type = self._vllm["AsyncEngineArgs"]
            check_engine_args(self.engine_args, {f for f in args_type.__dataclass_fields__})
            try:
                args = args_type(**self.engine_args)
                self._llm = await asyncio.to_thread(self._vllm["AsyncLLM"].from_engine_args, args)
            except Exception as err:
                raise VllmError(f"vLLM failed to start: {type(err).__name__}: {err}") from err
        model = self._llm.vllm_config.model_config
        self.context_length = int(model.max_model_len)
        self.vocab_size = int(model.get_vocab_size())
        return EngineConfig(
            model_input="tokens",
            context_length=self.context_length,
            model_type=list(EMBEDDING_MODEL_TYPE),
            capabilities=[DIMENSIONS_CAPABILITY] if model.is_matryoshka else [],
        )

    def _import(self) -> None:
        import_vllm()
        from vllm import PoolingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.async_llm import AsyncLLM

        try:  # vLLM's errors about the request itself: the client's 400
            from vllm.exceptions import VLLMClientError

            self._client_errors = (ValueError, TypeError, VLLMClientError)
        except ImportError:
            self._client_errors = (ValueError, TypeError)
        self._vllm = {
            "PoolingParams": PoolingParams,
            "AsyncEngineArgs": AsyncEngineArgs,
            "TokensPrompt": TokensPrompt,
            "AsyncLLM": AsyncLLM,
        }

    async def embed(self, request: PreprocessedEmbeddingRequest, context: Context) -> EmbeddingOutput:
        if self._closed or self._llm is None:
            raise EngineShutdown("the vllm embedding engine is not running")
        check_embedding_request(request, self.vocab_size, self.context_length)
        rids = [f"{context.id}-{next(self._ids)}" for _ in request.token_ids]
        try:
            params = self._vllm["PoolingParams"](task="embed", dimensions=request.dimensions)
        except self._client_errors as err:
            raise InvalidArgument(str(err), param="dimensions") from None
        jobs = [self._one(ids, params, rid) for ids, rid in zip(request.token_ids, rids, strict=True)]
        try:
            vectors = await asyncio.gather(*jobs)
        except self._client_errors as err:  # vLLM's checks of the request
            raise InvalidArgument(str(err), param="input") from None
        finally:
            if context.is_stopped():
                with contextlib.suppress(Exception):
                    await self._llm.abort(rids)
        tokens = sum(len(ids) for ids in request.token_ids)
        return EmbeddingOutput(embeddings=[unit_vector(v) for v in vectors], prompt_tokens=tokens)

    async def _one(self, ids: list[int], params: Any, rid: str) -> list[float]:
        prompt = self._vllm["TokensPrompt"](prompt_token_ids=ids)
        final = None
        async for out in self._llm.encode(prompt, params, rid):
            final = out
        if final is None:
            raise VllmError("vLLM ended an embedding request without output")
        return [float(v) for v in final.outputs.data.tolist()]

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
