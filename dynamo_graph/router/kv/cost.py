"""Choosing the worker rank for a request: Dynamo's KV routing cost, with fresher inputs.

This is the cost of `--router-cost dynamo`; the default, `predictive`, ranks by predicted time
to first token (predict.py) and shares the selection below. For every candidate rank `w`
(docs/routing.md), lower is better:

    overlap(w)        = prompt blocks w already has: the indexer's depth (KV events, or the
                        approximate indexer), or what w's in-flight requests hold, whichever is more
    new_tokens(w)     = isl - overlap(w) * block_size                        (at least 0)
    prefill_blocks(w) = (prefill tokens queued on w + 2 * new_tokens(w)) / block_size
    decode_blocks(w)  = blocks w's in-flight requests hold + prompt blocks w does not hold yet
    logit(w)          = overlap_score_weight * prefill_blocks(w) + decode_blocks(w)

Temperature 0 picks the minimum, ties going to the rank with the smallest cache (then at
random); above 0 it samples from a softmax over the negated, min-max-normalised logits, so the
temperature means the same whatever the block counts (1: the best rank is e times likelier than
the worst).

What differs from Dynamo, and why:

- Dynamo reads overlap only from KV events, which arrive after a worker has prefilled. A burst of
  requests sharing a new prefix therefore sees no overlap anywhere and computes the prefix on
  several workers, or, once one copy has landed, herds onto it while its in-flight accounting
  lags. Here the router's own bookkeeping (sequences.py) is updated synchronously on route,
  first token and completion, and counts the blocks of in-flight requests as cached on their
  worker, so the second request of a burst meets the first one's prefix at once and pays for
  the load it adds there.
- The tokens a request must compute count twice: once as its own wait (like the tokens already
  queued on that worker) and once as the delay they impose on every request queued behind them
  there (Dynamo counts them once). With single counting, a request that could share a prefix
  still being prefilled on a busy worker ties with recomputing it on an idle one (its own
  time-to-first-token is about the same either way), and the tie is often lost, so the prefix
  is computed twice and holds KV blocks twice. Measured with benchmarks/bench_routing.py
  (4 mockers, speedup 1, c=8): cold-prefix misses 7.7% -> 4.7% of requests, TTFT mean
  54 -> 51 ms, p90 69 -> 63 ms; c=32: mean 106 -> 98 ms. Between workers with the same overlap
  the choice is unchanged (only the queued tokens differ).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from dynamo_graph.router.kv.sequences import ActiveSequences, WorkerKey


class Choice(NamedTuple):  # a tuple: built for every candidate of every request
    key: WorkerKey
    overlap_blocks: int
    prefill_tokens: int  # the tokens this request will compute there
    logit: float


def overlap_of(
    key: WorkerKey,
    seq_hashes: Sequence[int],
    indexed_overlap: Mapping[WorkerKey, int],
    sequences: ActiveSequences,
) -> tuple[int, int]:
    """(prompt blocks `key` has: the indexer's depth or its in-flight requests', whichever is
    more; the in-flight depth alone)."""
    in_flight = sequences.prefix_depth(key, seq_hashes) if key in sequences.loads else 0
    return max(indexed_overlap.get(key, 0), in_flight), in_flight


def score_workers(
    candidates: Sequence[WorkerKey],
    seq_hashes: Sequence[int],
    isl: int,
    block_size: int,
    indexed_overlap: Mapping[WorkerKey, int],
    sequences: ActiveSequences,
    weight: float,
) -> list[Choice]:
    """The cost of sending the request to each candidate (see the module docstring)."""
    request_blocks = -(-isl // block_size)
    choices = []
    loads = sequences.loads
    for key in candidates:
        load = loads.get(key)
        overlap, in_flight = overlap_of(key, seq_hashes, indexed_overlap, sequences)
        new_tokens = max(isl - overlap * block_size, 0)
        if load is None:
            logit = weight * 2 * new_tokens / block_size + request_blocks
        else:
            prefill_blocks = (load.prefill_tokens + 2 * new_tokens) / block_size
            logit = weight * prefill_blocks + len(load.blocks) + request_blocks - in_flight
        choices.append(Choice(key, overlap, new_tokens, logit))
    return choices


def select(
    choices: Sequence[Choice],
    temperature: float,
    rng: random.Random,
    tree_size: Callable[[WorkerKey], int] | None = None,
) -> Choice:
    """argmin (temperature 0, ties to the smallest cache, then random) or softmax sampling."""
    if not choices:
        raise ValueError("no worker to choose from")
    if len(choices) == 1:
        return choices[0]
    if temperature <= 0:
        best = min(c.logit for c in choices)
        tied = [c for c in choices if c.logit == best]
        if len(tied) > 1 and tree_size:
            sizes = [tree_size(c.key) for c in tied]
            smallest = min(sizes)
            tied = [c for c, size in zip(tied, sizes, strict=True) if size == smallest]
        return tied[0] if len(tied) == 1 else rng.choice(tied)
    logits = [c.logit for c in choices]
    low, high = min(logits), max(logits)
    if high == low:
        return rng.choice(choices)
    scale = (high - low) * temperature
    weights = [math.exp(-(logit - low) / scale) for logit in logits]
    draw = rng.random() * sum(weights)
    for choice, w in zip(choices, weights, strict=True):
        draw -= w
        if draw <= 0:
            return choice
    return choices[-1]
