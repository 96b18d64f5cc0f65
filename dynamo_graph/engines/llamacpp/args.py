"""`out=llamacpp`'s settings: its `--extra-engine-args` options, checked before anything loads,
what they become in llama.cpp's model and context parameters, and the GGUF file of the model
(the engine is engine.py; docs/engines/llamacpp.md lists the options). llama-cpp-python is
imported only when an engine is built, so that `dyngraph` runs without it and says how to
install it when it is needed."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.engines.registry import ENGINES

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

SOURCE = "--extra-engine-args"
INSTALL_HINT = f"engine 'llamacpp' needs llama-cpp-python: {ENGINES['llamacpp'].install}"
RANDOM_SEED = 4294967295  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed per sampler
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class LlamaCppError(RunConfigError):
    """llama-cpp-python missing, no usable GGUF, or a bad `--extra-engine-args` option."""


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as err:
        raise LlamaCppError(f"{INSTALL_HINT} ({err})") from None
    return llama_cpp


# ---- settings ----------------------------------------------------------------------------------

# key -> (kind, minimum) ; kind is "int", "bool" or "float". All but ours go to `Llama(...)`.
_OPTIONS: dict[str, tuple[str, float | None]] = {
    "n_parallel": ("int", 1),
    "n_ctx": ("int", 1),
    "n_threads": ("int", 1),
    "n_threads_batch": ("int", 1),
    "n_batch": ("int", 1),
    "n_ubatch": ("int", 1),
    "n_gpu_layers": ("int", -1),
    "main_gpu": ("int", 0),
    "seed": ("int", 0),
    "use_mmap": ("bool", None),
    "use_mlock": ("bool", None),
    "flash_attn": ("bool", None),
    "offload_kqv": ("bool", None),
    "last_n_tokens_size": ("int", 0),
    "rope_freq_base": ("float", 0.0),
    "rope_freq_scale": ("float", 0.0),
    "verbose": ("bool", None),
    "prefix_reuse": ("bool", None),
}
_OURS = {"n_parallel", "n_ctx", "prefix_reuse"}


@dataclass(frozen=True)
class LlamaCppArgs:
    n_parallel: int = 1
    n_ctx: int | None = None  # None: the model's context length
    prefix_reuse: bool = True
    seed: int = RANDOM_SEED
    llama_kwargs: dict[str, Any] = field(default_factory=dict)  # the rest, for Llama(...)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LlamaCppArgs:
        unknown = [key for key in data if key not in _OPTIONS]
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise LlamaCppError(
                f"{SOURCE}: unknown llamacpp option{'s' if len(unknown) > 1 else ''} {names}; "
                f"known options: {', '.join(_OPTIONS)}"
            )
        for key, value in data.items():
            _check(key, value)
        seed = data.get("seed", RANDOM_SEED)
        if seed > RANDOM_SEED:
            raise LlamaCppError(f"{SOURCE}: seed must be at most {RANDOM_SEED}, not {seed}")
        return cls(
            n_parallel=data.get("n_parallel", 1),
            n_ctx=data.get("n_ctx"),
            prefix_reuse=data.get("prefix_reuse", True),
            seed=seed,
            llama_kwargs={k: v for k, v in data.items() if k not in _OURS},
        )


def _check(key: str, value: Any) -> None:
    kind, minimum = _OPTIONS[key]
    if kind == "bool":
        if not isinstance(value, bool):
            raise LlamaCppError(f"{SOURCE}: {key} must be true or false, not {value!r}")
        return
    numeric = (int,) if kind == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        noun = "an integer" if kind == "int" else "a number"
        raise LlamaCppError(f"{SOURCE}: {key} must be {noun}, not {value!r}")
    if minimum is not None and value < minimum:
        raise LlamaCppError(f"{SOURCE}: {key} must be at least {minimum}, not {value}")


def args_from_settings(cfg: EngineSettings) -> LlamaCppArgs:
    data = cfg.engine_args()
    args = LlamaCppArgs.from_dict(data)
    if cfg.context_length is not None:
        if "n_ctx" in data and data["n_ctx"] != cfg.context_length:
            raise LlamaCppError(
                f"--context-length {cfg.context_length} conflicts with n_ctx={data['n_ctx']!r} in "
                f"{SOURCE}; give one of them"
            )
        args = LlamaCppArgs(
            n_parallel=args.n_parallel,
            n_ctx=cfg.context_length,
            prefix_reuse=args.prefix_reuse,
            seed=args.seed,
            llama_kwargs=args.llama_kwargs,
        )
    return args


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def model_params(lc: Any, args: LlamaCppArgs) -> Any:
    """llama.cpp's model parameters for the options (as llama-cpp-python's `Llama` sets them)."""
    kw = args.llama_kwargs
    params = lc.llama_model_default_params()
    layers = kw.get("n_gpu_layers", 0)
    params.n_gpu_layers = 0x7FFFFFFF if layers == -1 else layers  # -1: all of them
    params.main_gpu = kw.get("main_gpu", 0)
    mmap, mlock = kw.get("use_mmap", True), kw.get("use_mlock", False)
    if mmap:
        params.load_mode = lc.LLAMA_LOAD_MODE_MMAP_MLOCK if mlock else lc.LLAMA_LOAD_MODE_MMAP
    else:
        params.load_mode = lc.LLAMA_LOAD_MODE_MLOCK if mlock else lc.LLAMA_LOAD_MODE_NONE
    return params


def context_params(lc: Any, args: LlamaCppArgs, n_ctx_seq: int) -> Any:
    """llama.cpp's context parameters: one context of `n_parallel` sequences sharing a unified KV
    cache of `n_parallel * n_ctx_seq` cells (docs/engines/llamacpp.md: why unified). Threads: the options',
    else half the CPUs."""
    kw = args.llama_kwargs
    params = lc.llama_context_default_params()
    params.n_seq_max = args.n_parallel
    params.kv_unified = True
    params.n_ctx = n_ctx_seq * args.n_parallel
    params.n_batch = min(kw.get("n_batch", 512), params.n_ctx)
    params.n_ubatch = min(kw.get("n_ubatch", 512), params.n_batch)
    params.n_threads = kw.get("n_threads", max(1, available_cpus() // 2))
    params.n_threads_batch = kw.get("n_threads_batch", params.n_threads)
    params.flash_attn_type = (
        lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if kw.get("flash_attn") else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.offload_kqv = kw.get("offload_kqv", True)
    params.rope_freq_base = kw.get("rope_freq_base", 0.0)  # 0: the model's
    params.rope_freq_scale = kw.get("rope_freq_scale", 0.0)
    return params


def find_gguf(model: LocalModel) -> Path:
    """The model's GGUF: the file it was given as, else the one .gguf in its folder (for a split
    model, its first shard, which llama.cpp follows to the others)."""
    if model.gguf_path is not None:
        return model.gguf_path
    found = sorted(p for p in model.root.glob("*.gguf") if p.is_file())
    found += sorted(p for p in model.root.glob("*.GGUF") if p.is_file() and p not in found)
    if not found:
        raise LlamaCppError(
            f"out=llamacpp needs a GGUF model: {model.root} holds no .gguf file. Pass a .gguf file or "
            "a folder with one (convert HF weights with llama.cpp's convert_hf_to_gguf.py)"
        )
    firsts = [p for p in found if (m := _SHARD.search(p.name)) and int(m.group(1)) == 1]
    shards = [p for p in found if _SHARD.search(p.name)]
    if len(found) == 1:
        return found[0]
    if len(firsts) == 1 and len(shards) == len(found):
        return firsts[0]
    names = ", ".join(p.name for p in found)
    raise LlamaCppError(
        f"{model.root} holds several GGUF files ({names}); pass the one to serve as --model-path FILE.gguf"
    )
