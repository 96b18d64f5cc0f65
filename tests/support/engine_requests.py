"""What the real-engine integration tests (test_llamacpp_engine.py, test_vllm_engine.py) share: llama.cpp's
own greedy ids as the reference, greedy token requests and their outputs, and an openai chat stream."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dynamo_graph.backend.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo_graph.runtime.context import Context


@contextmanager
def llama_greedy_reference(gguf: Path, n_ctx: int = 512) -> Iterator[Any]:
    """`generate(prompt, n)`: llama.cpp's own greedy `Llama.generate` (fresh state each call)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, verbose=False)

    def generate(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            if len(out) == n:
                break
        return out

    try:
        yield generate
    finally:
        llm.close()


def greedy_request(
    prompt: list[int], max_tokens: int | None = 16, *, eos_token_ids: Sequence[int], **kw: Any
) -> PreprocessedRequest:
    """A token request, greedy unless `sampling=` says otherwise; other keywords are stop conditions."""
    sampling = kw.pop("sampling", SamplingOptions(temperature=0.0))
    return PreprocessedRequest(
        model="tiny",
        token_ids=prompt,
        stop_conditions=StopConditions(max_tokens=max_tokens, **kw),
        sampling_options=sampling,
        eos_token_ids=list(eos_token_ids),
    )


async def collect(engine: Any, req: PreprocessedRequest, ctx: Context | None = None) -> list[LLMEngineOutput]:
    return [out async for out in engine.generate(req, ctx or Context())]


def ids(outs: list[LLMEngineOutput]) -> list[int]:
    return [t for out in outs for t in out.token_ids]


def stream_chat(client: Any, model: str, messages: list[dict], max_tokens: int) -> tuple[str, Any, Any]:
    """A greedy streamed chat completion with the openai client: (text, last finish_reason, usage)."""
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return text, finish, usage
