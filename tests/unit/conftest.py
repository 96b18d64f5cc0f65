"""Tokenizers for the llm unit tests: the tiny byte-level BPE model's, and a SentencePiece-style
one (Metaspace + byte fallback, like Llama-2 / Mistral) that exercises the generic detokenizer."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dynamo_graph.dev.tiny_tokenizer import write_tokenizer_files
from dynamo_graph.llm.detokenizer import DetokenizerFactory

CONTEXT_LENGTH = 512


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tokenizer_files(out, CONTEXT_LENGTH)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def detok_factory(tokenizer: Tokenizer) -> DetokenizerFactory:
    return DetokenizerFactory(tokenizer)


@pytest.fixture(scope="session")
def sp_tokenizer() -> Tokenizer:
    """Metaspace BPE with <0xNN> byte-fallback tokens: non-ASCII text becomes byte tokens."""
    topics = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    text = topics.read_text(encoding="utf-8")[:300_000]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator((text[i : i + 8192] for i in range(0, len(text), 8192)), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    vocab.update({f"<0x{b:02X}>": base + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="session")
def sp_factory(sp_tokenizer: Tokenizer) -> DetokenizerFactory:
    return DetokenizerFactory(sp_tokenizer)
