"""mistral.rs settings (`--extra-engine-args`, checked here) and a request's sampling fields
(docs/engines/mistralrs.md has both tables)."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
from dataclasses import dataclass, fields
from typing import Any

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import PreprocessedRequest
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.engines.registry import ENGINES
from dynamo_graph.engines.sampling import guided, refuse_several_choices

INSTALL_HINT = str(ENGINES["mistralrs"].install)
# config.json model_type -> mistral.rs Architecture member.
ARCH_BY_MODEL_TYPE = {
    "mistral": "Mistral",
    "gemma": "Gemma",
    "mixtral": "Mixtral",
    "llama": "Llama",
    "phi": "Phi2",
    "phi3": "Phi3",
    "phimoe": "Phi3_5MoE",
    "qwen2": "Qwen2",
    "gemma2": "Gemma2",
    "starcoder2": "Starcoder2",
    "deepseek_v2": "DeepseekV2",
    "deepseek_v3": "DeepseekV3",
    "qwen3": "Qwen3",
    "glm4": "GLM4",
    "glm4_moe": "GLM4Moe",
    "glm4_moe_lite": "GLM4MoeLite",
    "qwen3_moe": "Qwen3Moe",
    "smollm3": "SmolLm3",
    "granitemoehybrid": "GraniteMoeHybrid",
    "gpt_oss": "GptOss",
    "qwen3_next": "Qwen3Next",
    "lfm2": "Lfm2",
    "lfm2_moe": "Lfm2Moe",
}
_DTYPES = ("auto", "f32", "f16", "bf16")


class MistralrsError(RunConfigError):
    """mistral.rs is missing, a setting is bad, or the model cannot be loaded (printed by the CLI)."""


def import_mistralrs() -> Any:
    try:
        return importlib.import_module("mistralrs")
    except ImportError as err:
        raise MistralrsError(
            f"out=mistralrs needs the mistralrs package, which is not installed ({err}); "
            f"install it with: {INSTALL_HINT}"
        ) from None


def cpu_build() -> bool:
    """The plain `mistralrs` wheel is the CPU build (GPU builds are mistralrs-cuda, -metal, ...)."""
    try:
        importlib.metadata.distribution("mistralrs")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class MistralrsArgs:
    dtype: str | None = None  # None: f32 on the CPU build, else auto
    max_seqs: int = 16
    max_waiting: int = 256
    prefix_cache_n: int = 16
    no_kv_cache: bool = False
    in_situ_quant: str | None = None
    arch: str | None = None

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> MistralrsArgs:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise MistralrsError(
                f"--extra-engine-args: unknown mistralrs setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(known)}"
            )
        args = cls(**data)
        args.check()
        return args

    def check(self) -> None:
        def bad(key: str, want: str) -> MistralrsError:
            return MistralrsError(f"--extra-engine-args: {key} must be {want}, not {getattr(self, key)!r}")

        if self.dtype is not None and (not isinstance(self.dtype, str) or self.dtype.lower() not in _DTYPES):
            raise bad("dtype", f"one of {', '.join(_DTYPES)}")
        for key, minimum in (("max_seqs", 1), ("max_waiting", 0), ("prefix_cache_n", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise bad(key, f"an integer >= {minimum}")
        if not isinstance(self.no_kv_cache, bool):
            raise bad("no_kv_cache", "true or false")
        for key in ("in_situ_quant", "arch"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise bad(key, "a string")


def sampling_fields(request: PreprocessedRequest) -> dict[str, Any]:
    """mistral.rs request fields for the request's sampling options."""
    refuse_several_choices(request, "mistralrs")
    so = request.sampling_options
    kw: dict[str, Any] = {"temperature": so.temperature or 0.0}
    if so.temperature:
        for key in ("top_p", "top_k", "min_p"):
            value = getattr(so, key)
            if value is not None:
                kw[key] = value
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(so, key)
        if value is not None:
            kw[key] = value
    if so.logit_bias:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in so.logit_bias.items()}
        except ValueError:
            raise InvalidArgument("logit_bias keys must be token ids", param="logit_bias") from None
    spec = guided(so)
    if spec is not None and spec.kind == "grammar":
        raise InvalidArgument("out=mistralrs does not support guided_grammar", param="guided_grammar")
    if spec is not None:  # a regex (choices too) or a JSON schema
        value = spec.value if spec.kind != "json" or isinstance(spec.value, str) else json.dumps(spec.value)
        kw["grammar"], kw["grammar_type"] = value, "json_schema" if spec.kind == "json" else "regex"
    return kw
