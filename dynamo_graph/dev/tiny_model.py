"""Build the tiny model: a real Llama checkpoint (HF folder + GGUF) with random weights, in seconds.

No model hub is reachable from CI, so tests exercise the real loading code (tokenizer, chat
template, config, safetensors, GGUF) on a model small enough to write at test time. Weights come
from numpy with a fixed seed and every file is written in a fixed order, so the output is
byte-identical across runs on the same Python (the tokenizer corpus is the stdlib).
What the tests use it for: docs/testing.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from dynamo_graph.dev.tiny_tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    END_OF_TEXT_ID,
    EOT_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    write_tokenizer_files,
)

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 512
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
INIT_STD = 0.02
EOS_IDS = [EOT_ID, END_OF_TEXT_ID]
GGUF_NAME = "tiny-llama-f32.gguf"
# Written last by build_tiny_model; its content pins the recipe version and build options, so
# ensure_tiny_model rebuilds a folder made by an older recipe or with other options.
MARKER = ".dyngraph-tiny-model.json"
RECIPE_VERSION = 1


def _config(context_length: int) -> dict[str, Any]:
    """config.json as transformers 5 writes it, plus a top-level rope_theta (mistral.rs needs it)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_IDS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": INIT_STD,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": context_length,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": PAD_ID,
        "pretraining_tp": 1,
        "rms_norm_eps": RMS_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "5.19.0",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def _weights(allow_eos: bool) -> dict[str, np.ndarray]:
    """HF Llama tensors (fp32, [out, in]), drawn in a fixed order from one seeded generator."""
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(INIT_STD)

    def ones() -> np.ndarray:
        return np.ones(HIDDEN, dtype=np.float32)

    w = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        w[f"{p}.self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[f"{p}.self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[f"{p}.self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        w[f"{p}.mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[f"{p}.mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[f"{p}.mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        w[f"{p}.input_layernorm.weight"] = ones()
        w[f"{p}.post_attention_layernorm.weight"] = ones()
    w["model.norm.weight"] = ones()
    lm_head = normal(VOCAB_SIZE, HIDDEN)
    if not allow_eos:
        # Zero logits for the specials: greedy decoding never picks them, so output lengths are fixed.
        lm_head[: len(SPECIAL_TOKENS)] = 0.0
    w["lm_head.weight"] = lm_head
    return w


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: HF's rotate-half layout -> GGML's interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Map HF tensor names to llama.cpp's GGUF names (from gguf's own table), permuting q/k."""
    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES

    def name(t: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
        return names[t].format(bid=bid) + ".weight"

    out = {
        name(T.TOKEN_EMBD): weights["model.embed_tokens.weight"],
        name(T.OUTPUT_NORM): weights["model.norm.weight"],
        name(T.OUTPUT): weights["lm_head.weight"],
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out[name(T.ATTN_NORM, i)] = weights[f"{p}.input_layernorm.weight"]
        out[name(T.ATTN_Q, i)] = _permute_qk(weights[f"{p}.self_attn.q_proj.weight"], HEADS)
        out[name(T.ATTN_K, i)] = _permute_qk(weights[f"{p}.self_attn.k_proj.weight"], KV_HEADS)
        out[name(T.ATTN_V, i)] = weights[f"{p}.self_attn.v_proj.weight"]
        out[name(T.ATTN_OUT, i)] = weights[f"{p}.self_attn.o_proj.weight"]
        out[name(T.FFN_NORM, i)] = weights[f"{p}.post_attention_layernorm.weight"]
        out[name(T.FFN_GATE, i)] = weights[f"{p}.mlp.gate_proj.weight"]
        out[name(T.FFN_UP, i)] = weights[f"{p}.mlp.up_proj.weight"]
        out[name(T.FFN_DOWN, i)] = weights[f"{p}.mlp.down_proj.weight"]
    return out


def _write_gguf(
    path: Path, tok: Tokenizer, tokenizer_json: Path, weights: dict[str, np.ndarray], context_length: int
) -> None:
    """Write the GGUF directly: llama.cpp's converter can't identify a home-made BPE pre-tokenizer."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    merges = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(VOCAB_SIZE)
    w.add_context_length(context_length)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_tokenizer_model("gpt2")
    # llama.cpp's spelling; "gpt2" fails at load with "unknown pre-tokenizer type: 'gpt2'".
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOT_ID)
    w.add_eot_token_id(EOT_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, data in _gguf_tensors(weights).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _marker(allow_eos: bool, context_length: int) -> str:
    return json.dumps(
        {"recipe": RECIPE_VERSION, "allow_eos": allow_eos, "context_length": context_length}, sort_keys=True
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def build_tiny_model(out_dir: Path, *, allow_eos: bool = False, context_length: int = 512) -> Path:
    """Write the tiny model (HF folder files + GGUF) into out_dir and return out_dir.

    allow_eos keeps the special tokens' lm_head rows, so the model may end generation by itself.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer_files(out_dir, context_length)
    _write_json(out_dir / "config.json", _config(context_length))
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_IDS,
            "pad_token_id": PAD_ID,
            "transformers_version": "5.19.0",
        },
    )
    weights = _weights(allow_eos)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_gguf(out_dir / GGUF_NAME, tok, out_dir / "tokenizer.json", weights, context_length)
    (out_dir / MARKER).write_text(_marker(allow_eos, context_length), encoding="utf-8")
    return out_dir


def _is_built(out_dir: Path, marker: str) -> bool:
    try:
        return (out_dir / MARKER).read_text(encoding="utf-8") == marker
    except OSError:
        return False


def ensure_tiny_model(out_dir: Path, *, allow_eos: bool = False, context_length: int = 512) -> Path:
    """Build the tiny model into out_dir unless a complete build with the same options is there.

    Safe when several processes race (pytest-xdist workers, parallel CI jobs): each builds in a
    private temp dir beside out_dir and renames it into place; a loser finds the winner's build.
    A non-empty out_dir that is not a tiny-model build is never deleted.
    """
    out_dir = Path(out_dir)
    marker = _marker(allow_eos, context_length)
    if _is_built(out_dir, marker):
        return out_dir
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise FileExistsError(
            f"{out_dir} is not empty and holds no tiny-model build; remove it or pick another dir"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the final folder should be like any other
    try:
        build_tiny_model(tmp, allow_eos=allow_eos, context_length=context_length)
        if _is_built(out_dir, marker):
            return out_dir  # another process finished first
        if out_dir.exists():
            # A stale build (other recipe or options): move it aside atomically, then delete it.
            stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.replace(out_dir, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            # Another process renamed its build into place between our checks; use it if it fits.
            if not _is_built(out_dir, marker):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
