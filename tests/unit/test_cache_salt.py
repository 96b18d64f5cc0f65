"""Cache salts: a salt seeds a prompt's first block only, so requests of other salts share no
block, in the router's hashes (with and without a cached prefix), the mocker's prefix cache and
its KV events, which agree with the router's; and the frontend's salt keeps tenants apart."""

from __future__ import annotations

from collections.abc import Sequence

from dynamo_graph.engines.mocker.scheduler import MockSequence, TokenSampler, sampling_seed
from dynamo_graph.frontend.tenant_limits import Tenant
from dynamo_graph.frontend.tenants import cache_salt
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.prefix_hashes import PrefixHashCache
from dynamo_graph.router.kv.protocols import StoredBlock
from dynamo_graph.runtime.context import Context
from tests.support.mocker_steps import VOCAB, run, scheduler

PROMPT = list(range(1, 42))  # 10 full blocks of 4, and one token


def seq(prompt: Sequence[int], salt: str | None) -> MockSequence:
    sampler = TokenSampler(sampling_seed(prompt), VOCAB, frozenset())
    return MockSequence(Context(), prompt, max_tokens=2, sampler=sampler, salt=salt)


def test_a_salt_changes_the_first_local_hash_and_every_sequence_hash() -> None:
    plain = local_block_hashes(PROMPT, 4)
    a, b = local_block_hashes(PROMPT, 4, salt="a"), local_block_hashes(PROMPT, 4, salt="b")
    assert a[0] != plain[0] and b[0] != plain[0] and a[0] != b[0]
    assert a[1:] == plain[1:] == b[1:]  # only the first block is seeded
    seqs = [sequence_hashes(h) for h in (plain, a, b)]
    assert not set(seqs[0]) & set(seqs[1]) and not set(seqs[1]) & set(seqs[2])
    assert local_block_hashes(PROMPT, 4, salt="a") == a  # deterministic
    assert local_block_hashes(PROMPT, 4, salt="") == plain  # an empty salt is none


def test_the_prefix_cache_keeps_salts_apart_and_matches_hashing_the_whole_prompt() -> None:
    cache = PrefixHashCache(4)
    prefixes = [(24, b"k" * 16)]
    for salt in (None, "a", "b", "a", None):
        local, seq_ = cache.hashes(PROMPT, prefixes, salt)
        expected = local_block_hashes(PROMPT, 4, salt=salt)
        assert (local, seq_) == (expected, sequence_hashes(expected))
    assert cache.hits == 2 and cache.misses == 3  # the repeats of "a" and None hit


def test_the_mocker_reuses_a_prefix_only_under_the_same_salt() -> None:
    sched = scheduler(block_size=4)
    hits = []
    for salt in ("a", "b", "a", None):
        s = seq(PROMPT, salt)
        sched.add(s)
        run(sched)
        hits.append(s.cached_tokens)
    assert hits == [0, 0, 40, 0]


def test_the_mocker_reports_salted_blocks_as_the_router_hashes_them() -> None:
    sched = scheduler(block_size=4)
    short = list(range(1, 4))  # the first block fills during decode: it must be salted too
    s = MockSequence(
        Context(),
        short,
        max_tokens=3,
        sampler=TokenSampler(sampling_seed(short), VOCAB, frozenset()),
        salt="t",
    )
    sched.add(s)
    events = [ev for st in run(sched) for ev in st.events]
    stored = [b for ev in events if ev[0] == "stored" for b in ev[2]]
    local = local_block_hashes(s.tokens[:4], 4, salt="t")
    assert stored == [StoredBlock(sequence_hashes(local)[0], local[0])]
    sched.add(seq(PROMPT, "t"))
    events = [ev for st in run(sched) for ev in st.events]
    local = local_block_hashes(PROMPT, 4, salt="t")
    router = [StoredBlock(h, loc) for h, loc in zip(sequence_hashes(local), local, strict=True)]
    assert [b for ev in events if ev[0] == "stored" for b in ev[2]] == router


def test_the_frontend_salt_keeps_tenants_apart_and_groups_together() -> None:
    a, b = Tenant("team-a"), Tenant("team-b")
    ga, gb = Tenant("team-a", cache_group="shared"), Tenant("team-b", cache_group="shared")
    assert cache_salt(None, None) is None
    assert cache_salt(a, None) != cache_salt(b, None)
    assert cache_salt(ga, None) == cache_salt(gb, None) != cache_salt(a, None)
    assert cache_salt(a, "x") != cache_salt(a, None) and cache_salt(a, "x") != cache_salt(b, "x")
    # A group named like a tenant, or a request's salt spelling a tenant's, is still apart.
    assert cache_salt(Tenant("c", cache_group="team-a"), None) != cache_salt(a, None)
    assert cache_salt(None, cache_salt(a, None)) != cache_salt(a, None)
    assert cache_salt(None, '["tenant:team-a",null]') != cache_salt(a, None)
