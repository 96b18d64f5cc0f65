"""KV handoffs of `out=llamacpp`: a prompt's llama.cpp sequence state as bytes, and back.

A prefill worker exports the sequence of its context that evaluated the prompt with
`llama_state_seq_get_size` / `llama_state_seq_get_data`; a decode worker loads it into a free
sequence of its own context with `llama_state_seq_set_data`. The sequence calls, not the
whole-context `llama_state_get_data`: the engine's context serves several requests as sequences,
and these calls carry that one sequence's KV cells and nothing else (no logits or output buffers,
which the decode side recomputes anyway when it evaluates the first token). A state exported from
sequence 3 of one context loads as sequence 0 of another: the sequence id is not part of it. With
llama-cpp-python 0.3.36, a prompt's state imported into another context continues with the same
greedy tokens as the context that computed it (tests/integration/test_llamacpp_engine.py; on a
GPU the logits were also compared, bit for bit: docs/engines/llamacpp.md).

The handoff's bytes (format "llamacpp-state/1"): the prompt's token ids (u32 count, then u32 ids,
little-endian) followed by the llama.cpp sequence state. llama.cpp's state does not say which
tokens its cells hold; with the ids, the decode worker refuses KV that is not its request's prompt
instead of generating from the wrong context. The format string also names the model (a
fingerprint of its GGUF file) and the llama-cpp-python version (llama.cpp's state layout is its
own and changes between versions): a decode worker refuses another model's KV before loading it.
The context length is not part of the format: a state loads into any context with room for it,
and a request whose prompt does not fit the decode worker's context is refused as `generate`
refuses it (InvalidArgument), before the handoff is looked at.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo_graph.backend.engine import KvImportError
from dynamo_graph.backend.kv_transfer import KvHandoff

FORMAT = "llamacpp-state/1"
_WHOLE_FILE_BYTES = 16 << 20  # GGUFs up to this size are hashed whole
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 16


def gguf_fingerprint(path: Path) -> str:
    """A cheap identity of a GGUF file: sha256 over its size and, for a big file, 1 MiB pieces at
    evenly spaced offsets (the first holds the header: architecture, shapes, vocabulary), else the
    whole file. Models that differ in their weights differ in the pieces; reading all of a
    multi-GB file at every start would cost seconds. For a split model, its first shard."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            digest.update(f.read())
        else:
            for i in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def state_format(path: Path, llama_cpp_version: str) -> str:
    return f"{FORMAT}:gguf-{gguf_fingerprint(path)}:llama-cpp-python-{llama_cpp_version}"


def export_sequence(lc: Any, ctx: Any, fmt: str, tokens: Sequence[int], seq_id: int) -> KvHandoff:
    """The KV of `tokens`, which sequence `seq_id` of `ctx` holds (nothing else: they were just
    evaluated), as a handoff."""
    size = lc.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    written = lc.llama_state_seq_get_data(ctx, buf, size, seq_id)
    if written != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    header = struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens)
    return KvHandoff(fmt, len(tokens), header + bytes(buf))


def check_handoff(handoff: KvHandoff, fmt: str, prompt: Sequence[int]) -> None:
    """Refuse a handoff this engine cannot continue from, before anything is loaded. (Its size
    needs no check of its own: it covers fewer tokens than the prompt, which fits n_ctx.)"""
    if handoff.format != fmt:
        raise KvImportError(f"a {handoff.format!r} handoff cannot be loaded by {fmt!r}")
    n = handoff.num_tokens
    if not 0 < n < len(prompt):
        raise KvImportError(
            f"the handoff covers {n} tokens of a {len(prompt)}-token request: at least the first "
            "token after them must be left to evaluate"
        )
    head = 4 + 4 * n
    if len(handoff.data) < head or struct.unpack_from("<I", handoff.data)[0] != n:
        raise KvImportError(f"the handoff's data does not hold the ids of its {n} tokens")
    if struct.unpack_from(f"<{n}I", handoff.data, 4) != tuple(prompt[:n]):
        raise KvImportError("the handoff's KV is not of this request's prompt")


def import_sequence(lc: Any, ctx: Any, handoff: KvHandoff, seq_id: int) -> None:
    """Load a checked handoff's state into sequence `seq_id` of `ctx` (replacing what it held).
    Raises KvImportError when llama.cpp refuses it (truncated, another KV layout, no room) or it
    does not hold exactly the handoff's tokens; the sequence is then empty or to be cleared by the
    caller."""
    state = memoryview(handoff.data)[4 + 4 * handoff.num_tokens :]
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    read = lc.llama_state_seq_set_data(ctx, buf, len(state), seq_id)
    if read == 0:
        raise KvImportError(f"llama.cpp could not load the {len(state)}-byte sequence state")
    if read != len(state):
        raise KvImportError(f"llama.cpp read {read} of the {len(state)}-byte sequence state")
    last = lc.llama_memory_seq_pos_max(lc.llama_get_memory(ctx), seq_id)
    if last != handoff.num_tokens - 1:
        raise KvImportError(f"the state holds {last + 1} positions, not the {handoff.num_tokens} announced")
