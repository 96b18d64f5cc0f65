"""The prefill worker's store of KV handoffs: bounded in bytes, fetched once, expiring."""

from __future__ import annotations

import time

import pytest

from dynamo_graph.backend.errors import EngineOverloaded
from dynamo_graph.backend.kv_transfer import KvHandoff, KvStore


def handoff(size: int, tokens: int = 8) -> KvHandoff:
    return KvHandoff("test/1", tokens, b"x" * size)


def test_a_handoff_is_fetched_once() -> None:
    store = KvStore(max_bytes=100, ttl_s=30)
    tid = store.put(handoff(40))
    assert store.held_bytes == 40 and len(store) == 1
    got = store.take(tid)
    assert got is not None and got.data == b"x" * 40 and got.size == 40
    assert store.take(tid) is None and store.held_bytes == 0


def test_the_store_refuses_what_does_not_fit_and_frees_what_expires() -> None:
    store = KvStore(max_bytes=100, ttl_s=0.05)
    store.put(handoff(60))
    with pytest.raises(EngineOverloaded, match="DYN_KV_TRANSFER_MAX_MB"):
        store.put(handoff(60))
    time.sleep(0.06)
    tid = store.put(handoff(60))  # the first one expired unfetched: its bytes are free again
    assert store.expired == 1 and store.held_bytes == 60 and store.take(tid) is not None


def test_a_stand_in_handoff_counts_the_bytes_it_stands_for() -> None:
    stand_in = KvHandoff("mocker/1", 4, b"abcd", nbytes=4 * 131072)
    assert stand_in.size == 524288
    store = KvStore(max_bytes=10, ttl_s=30)
    assert store.take(store.put(stand_in)) is stand_in  # only the real bytes are held


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_KV_TRANSFER_MAX_MB", "2")
    monkeypatch.setenv("DYN_KV_TRANSFER_TTL_S", "5")
    store = KvStore()
    assert (store.max_bytes, store.ttl_s) == (2 << 20, 5.0)
    monkeypatch.setenv("DYN_KV_TRANSFER_TTL_S", "soon")
    with pytest.raises(ValueError, match="DYN_KV_TRANSFER_TTL_S must be a number"):
        KvStore()
