"""The model deployment card: workers of one model must agree on mdcsum wherever their files live."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.llm.card import CheckedFile, ModelDeploymentCard, slugify
from dynamo_graph.llm.model_source import resolve_model

HF_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", GGUF_NAME]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for n in HF_FILES:
        shutil.copy(src / n, dst / n)
    return dst


def _card(spec: Path, **kw: Any) -> ModelDeploymentCard:
    return ModelDeploymentCard.from_local_model(resolve_model(str(spec)), **kw)


def test_card_from_hf_folder(tiny_model: Path) -> None:
    card = _card(tiny_model)
    assert card.display_name == tiny_model.name
    assert card.source_path == str(tiny_model.absolute())
    assert (card.model_type, card.model_input) == (["chat", "completions"], "tokens")
    assert set(card.files) == {"config", "tokenizer", "tokenizer_config", "generation_config"}
    tok = card.files["tokenizer"]
    assert tok.path == str(tiny_model / "tokenizer.json")
    digest = hashlib.blake2b((tiny_model / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.checksum == f"blake2b:{digest}"
    assert card.chat_template and card.chat_template.startswith("{{- bos_token }}")
    assert (card.context_length, card.kv_cache_block_size, card.migration_limit) == (512, 16, 0)
    assert (card.bos_token_id, card.eos_token_ids) == (0, [4, 1])


def test_card_from_gguf_hashes_the_header(tiny_model: Path) -> None:
    card = _card(tiny_model / GGUF_NAME, model_input="text", model_type=["chat"])
    assert (card.model_type, card.model_input) == (["chat"], "text")
    assert set(card.files) == {"gguf"}
    assert card.files["gguf"].checksum.startswith("blake2b-gguf-header:")
    assert card.chat_template is not None and card.context_length == 512


def test_mdcsum_ignores_paths(tiny_model: Path, tmp_path: Path) -> None:
    # Two hosts, same model folder name and content, different locations.
    a, b = _copy(tiny_model, tmp_path / "host-a" / "tiny"), _copy(tiny_model, tmp_path / "host-b" / "tiny")
    card_a, card_b = _card(a), _card(b)
    assert card_a.files["tokenizer"].path != card_b.files["tokenizer"].path
    assert card_a.mdcsum() == card_b.mdcsum()
    assert _card(a / GGUF_NAME).mdcsum() == _card(b / GGUF_NAME).mdcsum()
    assert _card(a / GGUF_NAME).mdcsum() != card_a.mdcsum()


def test_mdcsum_changes_with_what_workers_must_agree_on(tiny_model: Path, tmp_path: Path) -> None:
    base = _card(tiny_model)
    assert _card(tiny_model, context_length=256).mdcsum() != base.mdcsum()
    assert _card(tiny_model, context_length=256).context_length == 256
    assert _card(tiny_model, kv_cache_block_size=32).mdcsum() != base.mdcsum()
    # migration_limit and user_data are per-worker settings, not model identity.
    assert _card(tiny_model, migration_limit=3, user_data={"k": 1}).mdcsum() == base.mdcsum()
    other = _copy(tiny_model, tmp_path / tiny_model.name)
    cfg = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.7}))
    assert _card(other).mdcsum() != base.mdcsum()


def test_json_round_trip(tiny_model: Path) -> None:
    card = _card(tiny_model, migration_limit=2, user_data={"lora": None, "tags": ["a"]})
    data = card.to_json()
    back = ModelDeploymentCard.from_json(data)
    assert back == card
    assert back.mdcsum() == card.mdcsum()
    assert isinstance(back.files["config"], CheckedFile)
    raw = json.loads(data)
    assert raw["migration_limit"] == 2 and raw["user_data"] == {"lora": None, "tags": ["a"]}
    assert "runtime_config" not in raw and "kv_cache_block_size" not in raw  # omit_defaults


@pytest.mark.parametrize(
    ("name", "slug"),
    [("Qwen/Qwen3-0.6B", "qwen_qwen3-0_6b"), ("tiny_model", "tiny_model"), ("Llama 3 ✨", "llama_3__")],
)
def test_slugify(name: str, slug: str) -> None:
    assert slugify(name) == slug
