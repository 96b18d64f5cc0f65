"""`out=mocker --embedding`: a simulated embedding worker (vLLM's pooling runner), no weights.

Vectors are deterministic, so routing, graphs and clients can be tested anywhere: each token id
stands for a fixed pseudo-random Gaussian vector of `embedding_dim` values (seeded by the id),
an input's vector is the mean of its tokens' (mean pooling), truncated to `dimensions` when asked
(as a Matryoshka model is) and scaled to unit length. Inputs sharing tokens get similar vectors,
so a retrieval test ranks as it would with a real model. Each request waits out the prefill of
all its tokens under the mocker's performance model (perf_model.py) divided by `speedup_ratio`.
"""

from __future__ import annotations

import asyncio
import random
from functools import lru_cache
from typing import TYPE_CHECKING

from dynamo_graph.backend.embedding import (
    DIMENSIONS_CAPABILITY,
    EMBEDDING_MODEL_TYPE,
    EmbeddingEngine,
    check_embedding_request,
    unit_vector,
)
from dynamo_graph.backend.engine import EngineConfig
from dynamo_graph.engines.mocker.args import MockerArgs, args_from_settings
from dynamo_graph.engines.mocker.engine import DEFAULT_MAX_MODEL_LEN, DEFAULT_VOCAB_SIZE
from dynamo_graph.engines.mocker.perf_model import PerfModel, PolynomialPerfModel
from dynamo_graph.llm.protocol import EmbeddingOutput, PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel


@lru_cache(maxsize=65536)
def token_vector(token_id: int, dim: int) -> tuple[float, ...]:
    """The fixed vector a token id stands for."""
    rng = random.Random(token_id)
    return tuple(rng.gauss(0.0, 1.0) for _ in range(dim))


def mean_pooled(token_ids: list[int], dim: int) -> list[float]:
    total = [0.0] * dim
    for token_id in token_ids:
        for j, v in enumerate(token_vector(token_id, dim)):
            total[j] += v
    n = len(token_ids)
    return [v / n for v in total]


class MockerEmbeddingEngine(EmbeddingEngine):
    """A simulated embedding model; see the module docstring."""

    def __init__(
        self,
        args: MockerArgs | None = None,
        *,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        max_model_len: int | None = None,
        perf_model: PerfModel | None = None,
    ) -> None:
        self.args = args or MockerArgs()
        self.vocab_size = vocab_size
        self.max_model_len = self.args.max_model_len or max_model_len or DEFAULT_MAX_MODEL_LEN
        self.perf_model = perf_model or PolynomialPerfModel()

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> MockerEmbeddingEngine:
        args = args_from_settings(cfg)
        if model is None:
            return cls(args)
        vocab = model.load_tokenizer().get_vocab_size(with_added_tokens=True)
        return cls(args, vocab_size=vocab, max_model_len=model.context_length)

    async def start(self, worker_id: int = 0) -> EngineConfig:
        return EngineConfig(
            model_input="tokens",
            context_length=self.max_model_len,
            max_num_seqs=self.args.max_num_seqs,
            model_type=list(EMBEDDING_MODEL_TYPE),
            capabilities=[DIMENSIONS_CAPABILITY],
        )

    async def embed(self, request: PreprocessedEmbeddingRequest, context: Context) -> EmbeddingOutput:
        check_embedding_request(request, self.vocab_size, self.max_model_len)
        tokens = sum(len(ids) for ids in request.token_ids)
        delay = self.perf_model.prefill_ms(tokens) / self.args.speedup_ratio / 1000.0
        if delay > 0:
            await asyncio.sleep(delay)
        dim = self.args.embedding_dim
        vectors = [unit_vector(mean_pooled(ids, dim), request.dimensions) for ids in request.token_ids]
        return EmbeddingOutput(embeddings=vectors, prompt_tokens=tokens)

    async def cleanup(self) -> None:
        """Nothing is held."""
