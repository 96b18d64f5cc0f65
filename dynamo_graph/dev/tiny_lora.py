"""Build a LoRA adapter for the tiny model: a PEFT folder (what vLLM loads) and a GGUF LoRA
(what llama.cpp loads), from the same seeded weights, in well under a second.

PEFT initialises `lora_B` to zeros (a fresh adapter changes nothing); ours draws both factors so
that the adapter moves the tiny model's greedy output, which is what tests check. The GGUF is
written with the `gguf` writer as llama.cpp's `convert_lora_to_gguf.py` lays it out: tensors
`blk.N.attn_q.weight.lora_a` / `.lora_b`, `general.type = adapter`, `adapter.type = lora`,
`adapter.lora.alpha`, and the q/k `lora_b` rows permuted as the base q/k weights are.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

from dynamo_graph.dev.tiny_model import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, _permute_qk

RANK = 8
ALPHA = 16
GGUF_LORA_NAME = "adapter.gguf"
# PEFT module name -> (in, out, GGUF tensor kind, heads whose rows llama.cpp permutes or 0)
_MODULES = {
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM, gguf.MODEL_TENSOR.ATTN_Q, HEADS),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM, gguf.MODEL_TENSOR.ATTN_K, KV_HEADS),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM, gguf.MODEL_TENSOR.ATTN_V, 0),
    "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN, gguf.MODEL_TENSOR.ATTN_OUT, 0),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN, gguf.MODEL_TENSOR.FFN_DOWN, 0),
}
STD = 0.08  # both factors: B@A*alpha/r is then several times the base weights' 0.02


def _factors(seed: int) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) -> (A [rank, in], B [out, rank]), drawn in a fixed order."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(LAYERS):
        for module, (fan_in, fan_out, _, _) in _MODULES.items():
            a = rng.standard_normal((RANK, fan_in), dtype=np.float32) * np.float32(STD)
            b = rng.standard_normal((fan_out, RANK), dtype=np.float32) * np.float32(STD)
            out[(i, module)] = (a, b)
    return out


def build_tiny_lora(out_dir: Path, base_model: str | Path, *, seed: int = 1) -> Path:
    """Write the adapter (adapter_config.json, adapter_model.safetensors, adapter.gguf) into
    out_dir and return out_dir. Another `seed`, another adapter."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    factors = _factors(seed)
    config = {
        "base_model_name_or_path": str(base_model),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": sorted(m.split(".")[-1] for m in _MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tensors = {}
    for (i, module), (a, b) in factors.items():
        prefix = f"base_model.model.model.layers.{i}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = a
        tensors[f"{prefix}.lora_B.weight"] = b
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_gguf_lora(out_dir / GGUF_LORA_NAME, factors)
    return out_dir


def _write_gguf_lora(path: Path, factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(ALPHA))
    w.add_name("tiny-llama-lora")
    for (i, module), (a, b) in factors.items():
        _, _, kind, heads = _MODULES[module]
        name = gguf.TENSOR_NAMES[kind].format(bid=i) + ".weight"
        w.add_tensor(f"{name}.lora_a", a)
        w.add_tensor(f"{name}.lora_b", _permute_qk(b, heads) if heads else b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
