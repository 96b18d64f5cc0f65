"""llama.cpp itself loads the tiny GGUF and tokenizes exactly as our GGUF-derived tokenizer does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.llm.model_source import resolve_model

llama_cpp = pytest.importorskip("llama_cpp")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces\n\nnew lines\ttabs",
    "emoji 🤖🎉 and CJK 你好世界",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "it's 12345 $3.14",
]


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Any:
    return llama_cpp.Llama(model_path=str(tiny_model / GGUF_NAME), n_ctx=512, verbose=False)


@pytest.mark.parametrize("text", TEXTS)
def test_llamacpp_tokenizes_like_our_tokenizer(llm: Any, tiny_model: Path, text: str) -> None:
    ours = resolve_model(str(tiny_model / GGUF_NAME)).load_tokenizer()
    assert llm.tokenize(text.encode(), add_bos=True, special=True) == ours.encode(text).ids


def test_llamacpp_greedy_generates(llm: Any, tiny_model: Path) -> None:
    ids = resolve_model(str(tiny_model / GGUF_NAME)).load_tokenizer().encode(TEXTS[0]).ids
    llm.reset()
    out: list[int] = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        out.append(tok)
        if len(out) == 8:
            break
    assert len(out) == 8
    assert all(t >= 6 for t in out)  # the special rows of lm_head are zero: greedy never picks them
