"""Block hashes that reuse a cached prefix's are bit-identical to hashing the whole prompt.

The property, over random conversations rendered by the tiny model's real chat template and
tokenized by its real tokenizer through the segment cache, requests that share and extend
earlier ones, and random block sizes: `PrefixHashCache.hashes(ids, prefixes)` equals
`local_block_hashes` / `sequence_hashes` of the ids, and a prefix key always names the same ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from xxhash import xxh3_128_digest

from dynamo_graph.llm.chat_template import ChatTemplate
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.llm.segment_tokenizer import LONG_SEGMENT_CHARS, SegmentTokenizer
from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.prefix_hashes import PrefixHashCache
from dynamo_graph.router.kv.router import KvRouter

ALPHABET = st.characters(codec="utf-8", exclude_categories=("Cs",))
SHORT = st.text(ALPHABET, max_size=120)
LONG = st.text(ALPHABET, min_size=LONG_SEGMENT_CHARS, max_size=900) | st.builds(
    lambda w, n: (w + " ") * n, st.sampled_from(["cache", "router", "ünï", "12"]), st.integers(60, 400)
)
MESSAGE = st.tuples(st.sampled_from(["user", "assistant"]), SHORT | LONG)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    return resolve_model(str(tiny_model))


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return model.load_tokenizer()


def full(ids: list[int], block_size: int) -> tuple[list[int], list[int]]:
    local = local_block_hashes(ids, block_size)
    return local, sequence_hashes(local)


@SETTINGS
@given(
    systems=st.lists(LONG | SHORT, min_size=1, max_size=3),
    turns=st.lists(st.tuples(st.integers(0, 2), st.lists(MESSAGE, min_size=1, max_size=4)), max_size=8),
    block_size=st.sampled_from([1, 2, 3, 16, 64]) | st.integers(1, 200),
)
def test_chats_hash_as_whole_prompts(model, tokenizer: Tokenizer, systems, turns, block_size) -> None:
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    segments = SegmentTokenizer(tokenizer)
    cache = PrefixHashCache(block_size)
    histories = [[{"role": "system", "content": s}] for s in systems]
    named: dict[bytes, list[int]] = {}
    for which, messages in turns:  # each turn extends one of the conversations
        history = histories[which % len(histories)]
        history.extend({"role": r, "content": c} for r, c in messages)
        prompt = template.render(history, add_generation_prompt=True)
        ids, prefixes = segments.encode_prefixed(prompt)
        assert ids == tokenizer.encode(prompt, add_special_tokens=False).ids
        for count, key in prefixes:
            assert named.setdefault(key, ids[:count]) == ids[:count]
        assert [n for n, _ in prefixes] == sorted(n for n, _ in prefixes)
        assert cache.hashes(ids, prefixes) == full(ids, block_size)
        assert cache.hashes(ids, prefixes) == full(ids, block_size)  # warm


@SETTINGS
@given(
    base=st.lists(st.integers(0, 2**32 - 1), max_size=600),
    prompts=st.lists(
        st.tuples(
            st.lists(st.integers(0, 600), max_size=3), st.lists(st.integers(0, 2**32 - 1), max_size=80)
        ),
        max_size=10,
    ),
    block_size=st.integers(1, 70),
    max_bytes=st.sampled_from([0, 500, 4000, 1 << 20]),
)
def test_any_split_points_hash_as_whole_prompts(base, prompts, block_size, max_bytes) -> None:
    """Prompts that are a shared base cut anywhere plus new ids, named prefixes at random
    points (keys: digests of the ids, as the segment tokenizer's name them), any cache budget."""
    cache = PrefixHashCache(block_size, max_bytes=max_bytes)
    for cuts, tail in prompts:
        points = sorted({min(c, len(base)) for c in cuts})
        ids = base[: points[-1]] + tail if points else tail
        prefixes = [(n, xxh3_128_digest(repr(base[:n]).encode())) for n in points]
        assert cache.hashes(ids, prefixes) == full(ids, block_size)
        assert cache.held_bytes <= max_bytes


def test_a_repeated_prefix_is_hashed_once(model, tokenizer: Tokenizer) -> None:
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    segments = SegmentTokenizer(tokenizer)
    cache = PrefixHashCache(16)
    document = "Answer from this document.\n\n" + "serving router prefix cache " * 300
    for question in ("Which words come up most?", "Why?", "And the least?"):
        chat = [{"role": "system", "content": document}, {"role": "user", "content": question}]
        ids, prefixes = segments.encode_prefixed(template.render(chat, add_generation_prompt=True))
        assert prefixes and prefixes[-1][0] > len(ids) - 40  # all but the question's turn
        assert cache.hashes(ids, prefixes) == full(ids, 16)
    assert (cache.misses, cache.hits, len(cache)) == (1, 2, 1)


def test_no_prefixes_when_the_segment_cache_is_off(tokenizer: Tokenizer) -> None:
    segments = SegmentTokenizer(tokenizer, max_bytes=0)
    text = "x " * 400
    assert segments.encode_prefixed(text) == (tokenizer.encode(text, add_special_tokens=False).ids, [])


def test_the_router_routes_the_same_with_and_without_prefixes(model, tokenizer: Tokenizer) -> None:
    """Two routers with the same seed, one given the prefixes: the same choices, overlaps and
    costs for a multi-turn workload over four workers."""
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    segments = SegmentTokenizer(tokenizer)
    config = RouterConfig(use_kv_events=False)  # the router indexes its own decisions
    reusing, hashing = KvRouter(16, config, seed=7), KvRouter(16, config, seed=7)
    workers = [11, 22, 33, 44]
    for n in range(24):
        chat = [{"role": "system", "content": f"Document {n % 3}. " + "cache router " * 200}]
        chat += [{"role": "user", "content": f"turn {t} " * (40 + t)} for t in range(n % 5)]
        ids, prefixes = segments.encode_prefixed(template.render(chat, add_generation_prompt=True))
        # The disagg decision's count (uncached tokens on the best worker) agrees as well.
        assert reusing.uncached_tokens(ids, workers, prefixes) == hashing.uncached_tokens(ids, workers)
        a = reusing.route(f"r{n}", ids, workers, prefixes=prefixes)
        b = hashing.route(f"r{n}", ids, workers)
        assert (a.key, a.overlap_blocks, a.logit) == (b.key, b.overlap_blocks, b.logit)
        if n % 2:
            for router in (reusing, hashing):
                router.free(f"r{n}")
    assert reusing.prefix_hashes.hits > 0 and reusing.overlap_blocks_routed > 0
    assert hashing.prefix_hashes.hits == 0


@SETTINGS
@given(
    base=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=400),
    cached=st.integers(0, 400),
    prompts=st.lists(
        st.tuples(
            st.lists(st.integers(0, 400), max_size=3), st.lists(st.integers(0, 2**32 - 1), max_size=60)
        ),
        min_size=1,
        max_size=8,
    ),
    block_size=st.integers(1, 40),
)
def test_uncached_tokens_are_the_same_with_and_without_prefixes(base, cached, prompts, block_size) -> None:
    """A worker holds a cut of a shared base; prompts are the base cut anywhere plus new ids,
    with named prefixes at random points: the uncached count with the prefixes' hashes reused
    equals the one from hashing every prompt whole, and the overlap it implies is right."""
    config = RouterConfig(use_kv_events=False)
    reusing, hashing = KvRouter(block_size, config, seed=1), KvRouter(block_size, config, seed=1)
    held = base[: min(cached, len(base))]
    for router in (reusing, hashing):
        router.route("held", held, [5])
    for cuts, tail in prompts:
        points = sorted({min(c, len(base)) for c in cuts})
        ids = base[: points[-1]] + tail if points else tail
        prefixes = [(n, xxh3_128_digest(repr(base[:n]).encode())) for n in points]
        count = reusing.uncached_tokens(ids, [5, 6], prefixes)
        assert count == hashing.uncached_tokens(ids, [5, 6])
        common = next((i for i, (a, b) in enumerate(zip(ids, held, strict=False)) if a != b), None)
        shared = min(len(ids), len(held)) if common is None else common
        assert count == len(ids) - (shared // block_size) * block_size


def test_the_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ROUTER_HASH_CACHE_MB", "0")  # off: every prompt hashed whole
    cache = PrefixHashCache(4)
    ids = list(range(40))
    prefixes = [(32, b"k" * 16)]
    assert cache.hashes(ids, prefixes) == cache.hashes(ids, prefixes) == full(ids, 4)
    assert len(cache) == 0 and cache.hits == 0
    monkeypatch.setenv("DYN_ROUTER_HASH_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="DYN_ROUTER_HASH_CACHE_MB"):
        PrefixHashCache(4)


def test_a_key_longer_than_the_prompt_is_not_reused() -> None:
    """Requests from another process could name a prefix wrongly: a cached prefix longer than
    the prompt is never taken for part of it."""
    cache = PrefixHashCache(4)
    cache.hashes(list(range(40)), [(40, b"k" * 16)])
    assert cache.hashes(list(range(9)), [(8, b"k" * 16)]) == full(list(range(9)), 4)
    assert cache.hits == 0


def test_each_turn_reuses_the_hashes_of_the_turns_before(model, tokenizer: Tokenizer) -> None:
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    segments = SegmentTokenizer(tokenizer)
    cache = PrefixHashCache(16)
    chat = [{"role": "system", "content": "Answer from this document.\n\n" + "cache router " * 200}]
    for turn in range(10):
        chat.append({"role": "user", "content": f"question {turn} " * 30})
        ids, prefixes = segments.encode_prefixed(template.render(chat, add_generation_prompt=True))
        assert len(prefixes) <= 4
        assert cache.hashes(ids, prefixes) == full(ids, 16)
        chat.append({"role": "assistant", "content": f"answer {turn} " * 30})
    assert (cache.misses, cache.hits) == (1, 9)
