"""The tiny model is what every engine test loads, so its files must be complete, valid and stable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

import dynamo_graph
from dynamo_graph.dev import tiny_model as tm
from dynamo_graph.dev.tiny_model import GGUF_NAME, build_tiny_model, ensure_tiny_model
from dynamo_graph.dev.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    GGUF_NAME,
]
REPO_ROOT = Path(dynamo_graph.__file__).resolve().parents[1]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _lm_head(folder: Path) -> np.ndarray:
    with safe_open(folder / "model.safetensors", framework="numpy") as f:
        return f.get_tensor("lm_head.weight")


def test_files_present(tiny_model: Path) -> None:
    for name in FILES:
        assert (tiny_model / name).is_file(), name


def test_build_is_byte_identical(tmp_path: Path) -> None:
    a = _digests(build_tiny_model(tmp_path / "a"))
    b = _digests(build_tiny_model(tmp_path / "b"))
    assert set(FILES) <= set(a)
    assert a == b


def test_config_files(tiny_model: Path) -> None:
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (256, 2, 4)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (2, 64, 512)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (2048, 512)
    assert cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 10000.0  # mistral.rs fails without the top-level key
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, [4, 1], 5)
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (0, [4, 1], 5)


def test_safetensors_names_and_shapes(tiny_model: Path) -> None:
    expected = {
        "model.embed_tokens.weight": (2048, 256),
        "model.norm.weight": (256,),
        "lm_head.weight": (2048, 256),
    }
    for i in range(2):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.self_attn.q_proj.weight": (256, 256),
            f"{p}.self_attn.k_proj.weight": (128, 256),
            f"{p}.self_attn.v_proj.weight": (128, 256),
            f"{p}.self_attn.o_proj.weight": (256, 256),
            f"{p}.mlp.gate_proj.weight": (512, 256),
            f"{p}.mlp.up_proj.weight": (512, 256),
            f"{p}.mlp.down_proj.weight": (256, 512),
            f"{p}.input_layernorm.weight": (256,),
            f"{p}.post_attention_layernorm.weight": (256,),
        }
    with safe_open(tiny_model / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(expected)
        for name, shape in expected.items():
            t = f.get_tensor(name)
            assert t.shape == shape and t.dtype == np.float32, name
        assert np.all(f.get_tensor("model.norm.weight") == 1.0)
        assert 0.015 < float(f.get_tensor("model.embed_tokens.weight").std()) < 0.025


def test_special_rows_of_lm_head_are_zero(tiny_model: Path) -> None:
    head = _lm_head(tiny_model)
    assert np.all(head[: len(SPECIAL_TOKENS)] == 0.0)
    assert np.all(np.abs(head[len(SPECIAL_TOKENS) :]).sum(axis=1) > 0)


def test_gguf_metadata_and_tensors(tiny_model: Path) -> None:
    reader = gguf.GGUFReader(tiny_model / GGUF_NAME)

    def field(key: str) -> object:
        return reader.fields[key].contents()

    assert field("general.architecture") == "llama"
    assert field("llama.context_length") == 512
    assert field("llama.embedding_length") == 256
    assert field("llama.block_count") == 2
    assert field("llama.feed_forward_length") == 512
    assert field("llama.attention.head_count") == 4
    assert field("llama.attention.head_count_kv") == 2
    assert field("llama.rope.dimension_count") == 64
    assert field("llama.rope.freq_base") == 10000.0
    assert field("llama.vocab_size") == 2048
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert field("tokenizer.ggml.model") == "gpt2"
    assert field("tokenizer.ggml.pre") == "gpt-2"  # llama.cpp rejects "gpt2"
    assert field("tokenizer.ggml.bos_token_id") == 0
    assert field("tokenizer.ggml.eos_token_id") == 4
    assert field("tokenizer.ggml.eot_token_id") == 4
    assert field("tokenizer.ggml.padding_token_id") == 5
    assert field("tokenizer.ggml.add_bos_token") is True
    assert field("tokenizer.chat_template") == CHAT_TEMPLATE

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tokens = field("tokenizer.ggml.tokens")
    assert tokens == [tok.id_to_token(i) for i in range(2048)]
    types = field("tokenizer.ggml.token_type")
    assert types[:6] == [gguf.TokenType.CONTROL] * 6
    assert set(types[6:]) == {gguf.TokenType.NORMAL}
    merges = json.loads((tiny_model / "tokenizer.json").read_text())["model"]["merges"]
    assert field("tokenizer.ggml.merges") == [" ".join(m) if isinstance(m, list) else m for m in merges]

    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 2 * 9
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    with safe_open(tiny_model / "model.safetensors", framework="numpy") as f:
        np.testing.assert_array_equal(
            np.asarray(tensors["output.weight"].data), f.get_tensor("lm_head.weight")
        )
        np.testing.assert_array_equal(
            np.asarray(tensors["blk.1.ffn_down.weight"].data),
            f.get_tensor("model.layers.1.mlp.down_proj.weight"),
        )
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    gq, gk = np.asarray(tensors["blk.0.attn_q.weight"].data), np.asarray(tensors["blk.0.attn_k.weight"].data)
    # llama.cpp's permute interleaves the two rotary halves of each head: row 1 of head 0 is HF row 32.
    np.testing.assert_array_equal(gq, tm._permute_qk(q, 4))
    np.testing.assert_array_equal(gq[1], q[32])
    np.testing.assert_array_equal(gk, tm._permute_qk(k, 2))
    np.testing.assert_array_equal(gk[64 + 1], k[64 + 32])


def test_ensure_reuses_a_complete_build(tiny_model: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()}
    assert ensure_tiny_model(tiny_model) == tiny_model
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()} == before


def test_ensure_rebuilds_when_options_change(tmp_path: Path) -> None:
    out = tmp_path / "m"
    ensure_tiny_model(out, allow_eos=True)
    assert np.all(np.abs(_lm_head(out)[:6]).sum(axis=1) > 0)
    ensure_tiny_model(out)
    assert np.all(_lm_head(out)[:6] == 0.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left behind


def test_ensure_never_deletes_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no tiny-model build"):
        ensure_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_ensure_is_safe_when_processes_race(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    code = "import sys; from pathlib import Path; from dynamo_graph.dev.tiny_model import ensure_tiny_model; "
    code += "ensure_tiny_model(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(out)], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert set(FILES) <= {p.name for p in out.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
    assert _digests(out) == _digests(build_tiny_model(tmp_path / "ref"))
