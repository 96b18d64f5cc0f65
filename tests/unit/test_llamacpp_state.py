"""The GGUF fingerprint that names a llama.cpp KV handoff's model (engines/llamacpp/state.py)."""

from __future__ import annotations

from pathlib import Path

from dynamo_graph.engines.llamacpp.state import gguf_fingerprint, state_format


def _write(path: Path, size: int, patches: dict[int, bytes]) -> Path:
    with path.open("wb") as f:
        f.truncate(size)  # sparse: zeros
        for offset, data in patches.items():
            f.seek(offset)
            f.write(data)
    return path


def test_a_small_gguf_is_fingerprinted_whole(tmp_path: Path) -> None:
    base = gguf_fingerprint(_write(tmp_path / "a.gguf", 4 << 20, {0: b"GGUF"}))
    assert base == gguf_fingerprint(_write(tmp_path / "b.gguf", 4 << 20, {0: b"GGUF"}))
    assert base != gguf_fingerprint(_write(tmp_path / "c.gguf", 4 << 20, {0: b"GGUF", 3 << 20: b"w"}))
    assert base != gguf_fingerprint(_write(tmp_path / "d.gguf", (4 << 20) + 1, {0: b"GGUF"}))


def test_a_big_gguf_is_fingerprinted_by_pieces_from_header_to_end(tmp_path: Path) -> None:
    size = 40 << 20
    base = gguf_fingerprint(_write(tmp_path / "a.gguf", size, {0: b"GGUF"}))
    # The header, a piece in the middle (16 evenly spaced 1 MiB pieces), the last weights; a
    # model that differs from another only between the pieces is not told apart (the price of
    # not reading every byte of a many-GB file at start).
    for offset in (100, (size - (1 << 20)) * 7 // 15 + 5, size - 1):
        changed = _write(tmp_path / f"at-{offset}.gguf", size, {0: b"GGUF", offset: b"w"})
        assert gguf_fingerprint(changed) != base, offset
    path = tmp_path / "a.gguf"
    assert state_format(path, "0.3.36") == f"llamacpp-state/1:gguf-{base}:llama-cpp-python-0.3.36"
