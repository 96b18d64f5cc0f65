"""The mocker's settings (`MockerArgs`), as Dynamo's `MockEngineArgs` names them.

They come from the `--extra-engine-args` JSON object; `--kv-cache-block-size` and
`--context-length` set `block_size` and `max_model_len` too (given both ways, they must agree).
As in Dynamo, an unknown key is an error that lists the known ones, and a bad value is named by
its key. The errors are `RunConfigError`s, so `dyngraph run` reports them like any bad flag.

| key | default | meaning |
|---|---|---|
| block_size | 64 | tokens per KV block |
| num_gpu_blocks | 16384 | KV cache capacity in blocks |
| max_num_seqs | 256 | most sequences running at once |
| max_num_batched_tokens | 8192 | tokens one forward pass may process |
| enable_prefix_caching | true | reuse cached blocks across requests (and publish KV events) |
| enable_chunked_prefill | true | split a long prompt across forward passes |
| watermark | 0.01 | fraction of the KV cache kept free when admitting requests |
| speedup_ratio | 1.0 | simulated time runs this much faster (> 0) |
| dp_size | 1 | data-parallel ranks, each its own scheduler and KV cache |
| max_model_len | null | longest sequence (prompt + output); null: the model's context length |
| kv_bytes_per_token | 131072 | KV cache bytes one token stands for in a P/D transfer (an 8B fp16 model's) |
| kv_transfer_gb_per_s | 25.0 | simulated KV transfer bandwidth between prefill and decode workers, GB/s |
| embedding_dim | 256 | length of the vectors an embedding mocker (`--embedding`) returns |
| scheduling_policy | "priority" | "fcfs" or "priority": waiting order and preemption victim |

`scheduling_policy` is vLLM's engine argument of that name, and its default is our vLLM worker's
(engines/vllm/engine.py): "priority", so requests marked urgent (`x-dynamo-request-priority`) are admitted
first without any setting; with every priority equal it behaves exactly as "fcfs" (queues.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.settings import RunConfigError

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings

SOURCE = "--extra-engine-args"
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's SchedulerPolicy


class MockerArgsError(RunConfigError):
    """A mocker setting that is unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class MockerArgs:
    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    speedup_ratio: float = 1.0
    dp_size: int = 1
    max_model_len: int | None = None
    kv_bytes_per_token: int = 131072
    kv_transfer_gb_per_s: float = 25.0
    embedding_dim: int = 256
    scheduling_policy: str = "priority"

    def __post_init__(self) -> None:
        keys = (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "dp_size",
            "embedding_dim",
        )
        for key in keys:
            _check_int(key, getattr(self, key), minimum=1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=1)
        for key in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, key), bool):
                raise MockerArgsError(f"{SOURCE}: {key} must be true or false, not {getattr(self, key)!r}")
        watermark = _check_number("watermark", self.watermark)
        if not 0.0 <= watermark < 1.0:
            raise MockerArgsError(f"{SOURCE}: watermark must be within [0, 1), not {watermark!r}")
        _check_int("kv_bytes_per_token", self.kv_bytes_per_token, minimum=0)
        if not _check_number("kv_transfer_gb_per_s", self.kv_transfer_gb_per_s) > 0.0:
            raise MockerArgsError(f"{SOURCE}: kv_transfer_gb_per_s must be greater than 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise MockerArgsError(
                f"{SOURCE}: scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"not {self.scheduling_policy!r}"
            )
        speedup = _check_number("speedup_ratio", self.speedup_ratio)
        if not speedup > 0.0:  # also rejects NaN
            raise MockerArgsError(f"{SOURCE}: speedup_ratio must be greater than 0, not {speedup!r}")

    @classmethod
    def known_keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MockerArgs:
        """Build from the `--extra-engine-args` object; unknown keys are rejected with the list."""
        known = cls.known_keys()
        unknown = [key for key in data if key not in known]
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise MockerArgsError(
                f"{SOURCE}: unknown mocker option{'s' if len(unknown) > 1 else ''} {names}; "
                f"known options: {', '.join(known)}"
            )
        return cls(**dict(data))

    @property
    def admission_blocks(self) -> int:
        """Blocks the running sequences may hold when a request is admitted (the watermark)."""
        return math.floor((1.0 - self.watermark) * self.num_gpu_blocks)


def _check_int(key: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MockerArgsError(f"{SOURCE}: {key} must be an integer, not {value!r}")
    if value < minimum:
        raise MockerArgsError(f"{SOURCE}: {key} must be at least {minimum}, not {value}")


def _check_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MockerArgsError(f"{SOURCE}: {key} must be a number, not {value!r}")
    return float(value)


_FLAGS = (
    ("kv_cache_block_size", "--kv-cache-block-size", "block_size"),
    ("context_length", "--context-length", "max_model_len"),
)


def args_from_settings(cfg: EngineSettings) -> MockerArgs:
    """`--extra-engine-args` plus the flags that name the same settings (they must not conflict)."""
    data = cfg.engine_args()
    args = MockerArgs.from_dict(data)
    for attr, flag, key in _FLAGS:
        value = getattr(cfg, attr)
        if value is None:
            continue
        if key in data and data[key] != value:
            raise MockerArgsError(
                f"{flag} {value} conflicts with {key}={data[key]!r} in {SOURCE}; give one of them"
            )
        args = replace(args, **{key: value})
    return args
