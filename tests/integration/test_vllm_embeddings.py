"""`out=vllm --embedding`: vLLM's pooling runner on the tiny model (CPU build), through the engine
contract. Its vectors must equal the model's own: the last token's final hidden state (the pooler
vLLM gives a converted decoder model), normalized, as Hugging Face transformers computes it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.engines.vllm.embed import VllmEmbeddingEngine
from dynamo_graph.llm.protocol import PreprocessedEmbeddingRequest
from dynamo_graph.runtime.context import Context

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
INPUTS = [[0, 17, 42, 300], [0, 5, 6, 7, 8, 9, 10], [0, 999]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[VllmEmbeddingEngine]:
    engine = VllmEmbeddingEngine(
        {"model": str(tiny_model), "dtype": "float32", "enforce_eager": True, "max_model_len": 512}
    )
    config = await engine.start()
    assert config.model_type == ["embedding"] and config.context_length == 512
    yield engine
    await engine.cleanup()


async def test_vectors_equal_the_models_last_hidden_state(
    engine: VllmEmbeddingEngine, tiny_model: Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = await engine.embed(PreprocessedEmbeddingRequest(model="m", token_ids=INPUTS), Context())
    assert out.prompt_tokens == sum(map(len, INPUTS))
    model = transformers.AutoModel.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    for ids, vector in zip(INPUTS, out.embeddings, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-4)


async def test_bad_requests_are_refused(engine: VllmEmbeddingEngine) -> None:
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        await engine.embed(PreprocessedEmbeddingRequest(model="m", token_ids=[[10**7]]), Context())
    with pytest.raises(InvalidArgument):
        await engine.embed(
            PreprocessedEmbeddingRequest(model="m", token_ids=[[1, 2]], dimensions=8), Context()
        )
