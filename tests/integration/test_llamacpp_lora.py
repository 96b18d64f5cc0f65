"""`out=llamacpp` with a GGUF LoRA adapter (the tiny model's, written by dyngraph.dev.tiny_lora):
greedy ids equal llama.cpp's own `Llama(lora_path=...)`, requests of the adapter and of the base
model run side by side in one context without mixing, and a cached prefix never crosses from one
to the other."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.lora import LoraAdapter, lora_id
from dynamo_graph.dev.tiny_lora import GGUF_LORA_NAME, build_tiny_lora
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.engines.llamacpp.args import LlamaCppArgs
from dynamo_graph.engines.llamacpp.engine import LlamaCppEngine
from dynamo_graph.llm.model_source import resolve_model
from tests.support.engine_requests import collect, greedy_request, ids
from tests.support.processes import running_server

if os.environ.get("CI"):
    import llama_cpp  # CI installs the llamacpp extra: a missing package must fail, not skip
else:
    llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = ["Once upon a time, in a land far away, there lived", "it's 12345 $3.14"]
N = 16
request = functools.partial(greedy_request, eos_token_ids=[4])


@pytest.fixture(scope="module")
def tiny_lora(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lora(tmp_path_factory.mktemp("tiny-lora"), tiny_model)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> list[list[int]]:
    tok = resolve_model(str(tiny_model)).load_tokenizer()
    return [tok.encode(p).ids for p in PROMPTS]


def llama_cpp_own(gguf: Path, lora: Path | None) -> Callable[[list[int]], list[int]]:
    kw = {} if lora is None else {"lora_path": str(lora)}
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, verbose=False, **kw)

    def generate(prompt: list[int]) -> list[int]:
        out: list[int] = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            if len(out) == N:
                return out
        return out

    return generate


@pytest.fixture
async def engine(tiny_model: Path, tiny_lora: Path) -> AsyncIterator[LlamaCppEngine]:
    eng = LlamaCppEngine(
        tiny_model / GGUF_NAME,
        LlamaCppArgs.from_dict({"n_parallel": 4}),
        default_n_ctx=512,
        tokenizer_vocab_size=2048,
    )
    await eng.start()
    await eng.load_lora(LoraAdapter("sql", str(tiny_lora), lora_id("sql")))  # the folder: its one .gguf
    yield eng
    await eng.cleanup()


def _req(prompt: list[int], model: str = "tiny"):  # type: ignore[no-untyped-def]
    req = request(prompt, N)
    req.model = model
    return req


async def test_adapter_greedy_ids_equal_llama_cpps_own(
    engine: LlamaCppEngine, tiny_model: Path, tiny_lora: Path, prompts: list[list[int]]
) -> None:
    base_ref = llama_cpp_own(tiny_model / GGUF_NAME, None)
    lora_ref = llama_cpp_own(tiny_model / GGUF_NAME, tiny_lora / GGUF_LORA_NAME)
    for prompt in prompts:
        with_adapter = ids(await collect(engine, _req(prompt, "sql")))
        assert with_adapter == lora_ref(prompt) != base_ref(prompt)
        # The same prompt for the base model right after: no cells of the adapter's are reused.
        base = await collect(engine, _req(prompt))
        assert ids(base) == base_ref(prompt) and (base[0].cached_tokens or 0) <= 1  # at most BOS, of base
        again = await collect(engine, _req(prompt, "sql"))
        assert ids(again) == with_adapter and (again[0].cached_tokens or 0) > 0  # its own prefix: reused


async def test_adapter_and_base_requests_run_side_by_side(
    engine: LlamaCppEngine, tiny_model: Path, tiny_lora: Path, prompts: list[list[int]]
) -> None:
    base_ref = llama_cpp_own(tiny_model / GGUF_NAME, None)
    lora_ref = llama_cpp_own(tiny_model / GGUF_NAME, tiny_lora / GGUF_LORA_NAME)
    jobs = [(prompt, model) for prompt in prompts for model in ("tiny", "sql")]
    results = await asyncio.gather(*(collect(engine, _req(p, m)) for p, m in jobs))
    for (prompt, model), outs in zip(jobs, results, strict=True):
        assert ids(outs) == (lora_ref if model == "sql" else base_ref)(prompt), model
    await engine.unload_lora("sql")
    assert ids(await collect(engine, _req(prompts[0], "sql"))) == base_ref(prompts[0])  # now just a name


async def test_a_file_that_is_not_a_lora_is_refused(
    engine: LlamaCppEngine, tiny_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgument) as err:
        await engine.load_lora(LoraAdapter("bad", str(tiny_model / GGUF_NAME), lora_id("bad")))
    assert err.value.param == "lora_path"
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(InvalidArgument, match=r"2 \.gguf files"):
        await engine.load_lora(LoraAdapter("bad", str(tmp_path), lora_id("bad")))


def test_http_adapter_of_lora_modules(
    tiny_model: Path, tiny_lora: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    """`dyngraph run in=http out=llamacpp --lora-modules`: the adapter is a model of its own."""
    import openai

    args = ["out=llamacpp", "--model-path", str(tiny_model), "--lora-modules", f"sql={tiny_lora}"]
    tok = resolve_model(str(tiny_model)).load_tokenizer()
    lora_ref = llama_cpp_own(tiny_model / GGUF_NAME, tiny_lora / GGUF_LORA_NAME)
    with running_server(args, log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="sql", prompt=prompts[0], max_tokens=N, temperature=0)
        assert answer.choices[0].text == tok.decode(lora_ref(prompts[0]), skip_special_tokens=False)
