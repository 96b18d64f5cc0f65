"""How long the mocker's simulated forward passes take.

The formulas are those of Dynamo's later mocker (`lib/mocker`, fitted to a vLLM worker; Dynamo
itself calls them "not scientific at all"), in milliseconds:

    prefill_ms(t) = 4.209989e-07 * t^2 + 1.518344e-02 * t + 16.50142      (t > 0 new tokens)
    decode_ms(p)  = max(1.0, -25.74 * p^2 + 54.01 * p + 5.74)             (p = KV usage, 0..1)

One iteration (one forward pass) takes

    iteration_ms = prefill_ms(T) + decode_ms(p) [if any sequence decodes]

where T is the total of new prompt tokens the pass processes (all chunks of all prefilling
sequences together: they share the pass, so the fixed cost is paid once, where Dynamo sums a
prefill time per sequence) and p is active KV blocks / num_gpu_blocks after the pass's
allocations. Decode cost does not depend on the batch size: that is continuous batching's point.
The engine divides by `speedup_ratio` and paces passes on a deadline clock.

`PerfModel` is the interface; `PolynomialPerfModel` with other coefficients (e.g. Dynamo's mid-2025
ones, `PolynomialPerfModel.dynamo_2025()`) or a table-driven model can replace it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class PerfModel(Protocol):
    def prefill_ms(self, new_tokens: int) -> float: ...

    def decode_ms(self, kv_usage: float) -> float: ...


@dataclass(frozen=True)
class PolynomialPerfModel:
    """prefill: a*t^2 + b*t + c; decode: max(floor, d*p^2 + e*p + f)."""

    prefill_a: float = 4.209989e-07
    prefill_b: float = 1.518344e-02
    prefill_c: float = 16.50142
    decode_d: float = -25.74
    decode_e: float = 54.01
    decode_f: float = 5.74
    decode_floor_ms: float = 1.0

    @classmethod
    def dynamo_2025(cls) -> PolynomialPerfModel:
        """The mid-2025 mocker's coefficients (prefill 1.25e-6 t^2 + 7.41e-2 t + 26.2,
        decode -5.47 p^2 + 43.88 p + 19.44)."""
        return cls(1.25e-6, 7.41e-2, 26.2, -5.47, 43.88, 19.44, 0.0)

    def prefill_ms(self, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return self.prefill_a * t * t + self.prefill_b * t + self.prefill_c

    def decode_ms(self, kv_usage: float) -> float:
        p = kv_usage
        return max(self.decode_floor_ms, self.decode_d * p * p + self.decode_e * p + self.decode_f)


def iteration_ms(model: PerfModel, prefill_tokens: int, decoding: int, kv_usage: float) -> float:
    """Simulated time of one forward pass (before `speedup_ratio`)."""
    ms = model.prefill_ms(prefill_tokens) if prefill_tokens > 0 else 0.0
    if decoding > 0:
        ms += model.decode_ms(kv_usage)
    return ms
