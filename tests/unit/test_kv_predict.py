"""The predictive router cost: the online TTFT fit, the prediction and the near-tie rule."""

from __future__ import annotations

import random

import pytest

from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.cost import Choice
from dynamo_graph.router.kv.predict import (
    DEFAULT_COEFFS,
    TtftFit,
    TtftModel,
    pick_near_best,
    predict_workers,
)
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.router.kv.sequences import ActiveSequences

BS = 16


def test_fit_recovers_the_coefficients_of_noisy_observations():
    rng = random.Random(0)
    a, b, c = 0.012, 3e-5, 2e-4
    fit = TtftFit()
    for _ in range(400):
        tokens, blocks = rng.randrange(0, 8000), rng.randrange(0, 400)
        fit.observe(tokens, blocks, (a + b * tokens + c * blocks) * rng.uniform(0.95, 1.05))
        fit.refit(DEFAULT_COEFFS)
    fa, fb, fc = fit.coeffs
    assert fa == pytest.approx(a, rel=0.25)
    assert fb == pytest.approx(b, rel=0.1)
    assert fc == pytest.approx(c, rel=0.25)


def test_fit_follows_a_worker_that_slows_down():
    fit = TtftFit()
    for _ in range(100):
        for tokens in (500, 2000, 4000):
            fit.observe(tokens, 0, 0.01 + 1e-5 * tokens)
        fit.refit(DEFAULT_COEFFS)
    assert fit.predict(4000, 0) == pytest.approx(0.05, rel=0.1)
    for _ in range(100):  # now 3x slower per token (e.g. a neighbour on its GPU)
        for tokens in (500, 2000, 4000):
            fit.observe(tokens, 0, 0.01 + 3e-5 * tokens)
        fit.refit(DEFAULT_COEFFS)
    assert fit.predict(4000, 0) == pytest.approx(0.13, rel=0.1)


def test_without_observations_the_fit_keeps_its_prior_and_never_goes_negative():
    fit = TtftFit()
    fit.refit((0.5, 0.001, 0.0))
    assert fit.coeffs == pytest.approx((0.5, 0.001, 0.0))
    for _ in range(50):  # TTFT falls as tokens grow: no negative cost per token
        fit.observe(1000, 0, 0.2)
        fit.observe(5000, 0, 0.1)
    fit.refit(DEFAULT_COEFFS)
    assert fit.coeffs[1] >= 0 and fit.coeffs[2] >= 0


def test_a_slower_worker_is_predicted_slower_and_avoided():
    model = TtftModel()
    fast, slow = (1, 0), (2, 0)
    for _ in range(60):
        for tokens in (256, 1024, 4096):
            model.observe(fast, tokens, 0, 0.005 + 1e-5 * tokens)
            model.observe(slow, tokens, 0, 0.005 + 4e-5 * tokens)
    choices = predict_workers([fast, slow], [], 2048, BS, {}, ActiveSequences(), model)
    by_key = {c.key: c.logit for c in choices}
    assert by_key[slow] == pytest.approx(3.5 * by_key[fast], rel=0.15)
    assert pick_near_best(choices, random.Random(0)).key == fast


def test_unobserved_workers_are_predicted_as_fast_as_the_fastest_fit():
    model = TtftModel()
    model.fit((9, 0))  # known before any observation
    for _ in range(80):
        model.observe((1, 0), 1000, 0, 0.002)
        model.observe((1, 0), 3000, 0, 0.004)
    # The observed 3 ms, not the pool's (shrunk towards the default's 120 ms).
    assert model.fit((9, 0)).predict(2000, 0) == pytest.approx(model.fit((1, 0)).predict(2000, 0), rel=0.05)
    assert model.fit((8, 0)).coeffs == model.fit((9, 0)).coeffs  # one met later is the same


def test_a_fresh_worker_beside_a_quick_one_gets_the_next_new_prefix():
    """Three quick answers from one worker must not make the untried one look slower: an idle
    deployment spreads new conversations (the pool alone is pulled towards the slow default)."""
    model = TtftModel()
    used, fresh = (1, 0), (2, 0)
    for tokens in (80, 110, 140):
        model.observe(used, tokens, 0, 0.003)
    choices = predict_workers([used, fresh], [], 90, BS, {}, ActiveSequences(), model)
    by_key = {c.key: c.logit for c in choices}
    assert by_key[fresh] <= by_key[used]
    sizes = {used: 12, fresh: 0}
    assert pick_near_best(choices, random.Random(0), sizes.__getitem__).key == fresh


def test_backlog_counts_the_queued_prefill_tokens():
    model = TtftModel()
    seqs = ActiveSequences()
    key = (1, 0)
    for _ in range(50):
        model.observe(key, 1000, 0, 0.01 + 1e-5 * 1000)
        model.observe(key, 5000, 0, 0.01 + 1e-5 * 5000)
    seqs.add("a", key, [1, 2, 3], prefill_tokens=3000)
    assert model.backlog_seconds(key, seqs) == pytest.approx(0.04, rel=0.1)
    seqs.prefill_completed("a")
    assert model.backlog_seconds(key, seqs) == 0.0
    choices = predict_workers([key], [], 1000, BS, {}, seqs, model)
    assert choices[0].logit == pytest.approx(0.02, rel=0.1)


def test_near_ties_go_to_the_prefix_holder_and_clear_wins_do_not():
    holder = Choice((1, 0), overlap_blocks=8, prefill_tokens=0, logit=0.105)
    idle = Choice((2, 0), overlap_blocks=0, prefill_tokens=128, logit=0.100)
    assert pick_near_best([idle, holder], random.Random(0)).key == (1, 0)  # 5% worse: tie
    busy_holder = holder._replace(logit=0.2)
    assert pick_near_best([idle, busy_holder], random.Random(0)).key == (2, 0)  # 2x worse


def test_near_ties_without_a_prefix_go_to_the_smallest_cache():
    a = Choice((1, 0), 0, 64, 0.0100)
    b = Choice((2, 0), 0, 64, 0.0102)
    sizes = {(1, 0): 500, (2, 0): 3}
    assert pick_near_best([a, b], random.Random(0), sizes.__getitem__).key == (2, 0)


def _router(**kw: object) -> KvRouter:
    return KvRouter(BS, RouterConfig(use_kv_events=False, **kw), seed=0)  # type: ignore[arg-type]


def test_concurrent_first_uses_of_a_prefix_meet_on_one_worker():
    router = _router()
    workers = [1, 2, 3, 4]
    prefix = list(range(1000, 1000 + 40 * BS))
    first = router.route("a", [*prefix, 1, 2, 3], workers)
    second = router.route("b", [*prefix, 4, 5, 6], workers)  # a's prefill is still running
    assert second.key == first.key
    assert second.overlap_blocks == 40


def test_a_long_queue_on_the_holder_makes_recomputing_better():
    router = _router()
    workers = [1, 2]
    prefix = list(range(1000, 1000 + 4 * BS))
    first = router.route("a", [*prefix, 1], workers)
    # The holder now has a long prefill queue (another huge prompt routed there).
    router.sequences.add("huge", first.key, [77], prefill_tokens=200_000)
    second = router.route("b", [*prefix, 2], workers)
    assert second.key != first.key


def test_observed_ttfts_feed_the_routers_model():
    clock = iter([0.0, 0.05, 1.0, 1.02]).__next__
    router = _router()
    router.model._clock = clock
    router.route("a", list(range(10 * BS)), [1])
    router.prefill_completed("a")
    router.route("b", list(range(5000, 5000 + 3 * BS)), [1])
    router.prefill_completed("b")
    router.free("a")
    router.free("b")
    fit = router.model.fits[(1, 0)]
    assert fit.observations == 2
    assert fit.predict(10 * BS, 0) > fit.predict(3 * BS, 0)


def test_dynamo_cost_stays_selectable():
    router = _router(cost="dynamo")
    choice = router.route("a", list(range(4 * BS)), [1, 2])
    assert choice.logit >= 4  # blocks, not seconds
    with pytest.raises(ValueError, match="cost must be one of predictive, dynamo"):
        _router(cost="fastest")


def _two_alike() -> TtftModel:
    """Two ranks fitted alike: 10 ms + 15 µs per prefill token (the mocker at speedup 1)."""
    model = TtftModel()
    for _ in range(40):
        for key in ((1, 0), (2, 0)):
            for tokens in (100, 2000, 6000):
                model.observe(key, tokens, 0, 0.010 + 15e-6 * tokens)
    return model


def test_a_busy_prefix_holder_keeps_its_prefix_rather_than_an_idle_worker_recomputing_it():
    """The holder's queue (a little more than the prefix) makes the request's own TTFT better on
    the idle worker, but recomputing the prefix there costs that worker's next requests its
    prefill time: with the penalty the prefix stays where it is."""
    model, holder, idle = _two_alike(), (1, 0), (2, 0)
    seqs = ActiveSequences()
    seqs.add("queued", holder, [], prefill_tokens=4800)
    isl = 256 * BS + 32
    overlap = {holder: 256}
    own = predict_workers([holder, idle], [], isl, BS, overlap, seqs, model)
    assert pick_near_best(own, random.Random(0)).key == idle
    charged = predict_workers([holder, idle], [], isl, BS, overlap, seqs, model, prefill_penalty=1.0)
    assert pick_near_best(charged, random.Random(0)).key == holder
    by_key = {c.key: c for c in charged}
    assert by_key[holder].logit == pytest.approx(
        next(c for c in own if c.key == holder).logit + 32 * 15e-6, rel=0.05
    )


def test_a_full_cache_is_charged_for_the_blocks_a_new_prefix_evicts():
    """Neither rank holds the prompt; the one whose cache is full would evict as many cached
    blocks as it stores, a recompute for a later request: the one with room gets it."""
    model, full, roomy = _two_alike(), (1, 0), (2, 0)
    model.observe(full, 100, 0, 0.005)  # the full one now looks a little faster
    seqs = ActiveSequences()
    spare = {full: 0, roomy: 500}
    isl = 128 * BS
    blind = predict_workers([full, roomy], [], isl, BS, {}, seqs, model, prefill_penalty=1.0)
    assert pick_near_best(blind, random.Random(0)).key == full
    aware = predict_workers([full, roomy], [], isl, BS, {}, seqs, model, 1.0, spare.get)
    assert pick_near_best(aware, random.Random(0)).key == roomy
    evicted = {c.key: c.logit for c in aware}[full] - {c.key: c.logit for c in blind}[full]
    assert evicted == pytest.approx(isl * model.pooled.coeffs[1])
