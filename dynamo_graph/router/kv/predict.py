"""The predictive router cost: send a request where its time to first token is predicted lowest.

For every candidate rank `w`, in seconds:

    backlog(w)   = prompt tokens queued on w: the larger of those routed to w and still
                   waiting for their first token (the router's own bookkeeping, sequences.py)
                   and those w last reported accepted and not yet computed (its load metrics,
                   reported.py: work another frontend sent is seen there)
    new(w)       = this request's tokens w has not cached (isl - overlap(w) * block_size)
    decode(w)    = KV blocks w's running requests hold: the larger of the router's bookkeeping
                   and w's last load metrics
    ttft(w)      = a(w) + b(w) * (backlog(w) + new(w)) + c(w) * decode(w)

a (fixed cost of the passes a prefill waits for), b (seconds per prefill token) and c (what the
decode batch adds to each pass, per held block) are fitted online per worker rank by
exponentially weighted least squares from the TTFTs the router observes (route -> first token),
each observation being (backlog + new tokens at routing time, decode blocks at routing time,
observed seconds). A slower worker, or one that shares its accelerator with someone else, gets a
larger b and is predicted as such. A rank with few observations leans on the pooled fit of all
ranks (its ridge prior), and the pool on a conservative default, so the first requests of a
fresh frontend already rank workers by tokens to compute. A rank not observed yet is predicted as
fast as the fastest fit (the least of each coefficient): the pool, shrunk towards the default,
is slower than a worker that has been answering quickly, and a fresh worker predicted slower
would never be tried, so an idle deployment would pile every new prefix onto the worker that
answered first. Optimism costs at most one request's worth of misjudgement per new worker.

Selection: the lowest predicted TTFT, except that predictions within `TIE_TOLERANCE` of the
best count as tied (two fits never agree exactly), and a tie goes to the rank holding the
deepest prefix, then to the smallest cache. Recomputing a prefix elsewhere to save a few percent
of one request's wait costs a second copy of the prefix in KV memory and another worker's
prefill time. So concurrent first uses of a new prefix meet on one worker (its in-flight blocks
count as its overlap) as long as waiting there is predicted no worse than computing the prefix
elsewhere by more than the tolerance; past that, the queue is worse than recomputing and the
request goes elsewhere. Among workers without the prefix, the smallest cache wins, so an idle
deployment spreads new prefixes instead of piling them on the worker that answered first.

What a pick costs besides the request's own wait (`--router-prefill-penalty`, 1 by default):
the tokens it computes delay every request queued behind it on that worker, and where that
worker's cache is full (its indexed blocks against the `total_kv_blocks` of its card) they evict
cached blocks that some later request will compute again. Both are charged at the pooled fit's
seconds per token (the same for every worker: it is the deployment's work, not this rank's
speed), times the penalty. Without it, a busy prefix holder and an idle worker that must
recompute the prefix predict about the same TTFT for the request, and the idle one, or the one
whose fit happens to be faster, wins: the prefix is computed twice, and one worker collects new
prefixes until its cache thrashes. Measured on issue 27's workload (24 documents of 4k tokens
asked about in one message, 2 mocker workers at speedup 1, c=8, new connections;
bench_doc_routing.py, three seeds, each against penalty 0 in the same run): the share of the
cache hits an oracle adds over round-robin that kv routing captures went from 70-85% to
98-100%, and round-robin's mean TTFT over kv's from 1.08-1.18x to 1.16-1.43x
(results/doc_routing_seed*.json; since re-measured two rounds per seed, in turns: 1.29-1.48x,
the spread being the shared machine's, docs/routing.md). The misses it removes were of both
kinds: a busy holder's prefix recomputed on the idle worker, and a worker whose fit looked
faster collecting new documents until its 1,024-block cache evicted them. The in-flight
bookkeeping (sequences.py) already keeps concurrent first uses of a document together before
its KV events arrive.

Why this form. In the mocker (perf_model.py, Dynamo's fit to a vLLM worker), a pass costs
16.5 ms + 0.0152 ms per prefill token (+ a small quadratic term) + decode_ms(kv usage), and
prefill tokens queued on a worker are computed in passes of up to max_num_batched_tokens; so the
wait of a request is close to linear in the prefill tokens ahead of it plus its own, with a
decode term per pass that grows with the running batch's KV. Dynamo's cost (cost.py) adds
prefill blocks and decode blocks with fixed weights, so it cannot tell a 2x slower worker from
a fast one, and it weighs a queued decode block like 1 to 64 prefill tokens regardless of the
hardware.

Measured (benchmarks/bench_router_predict.py, results/router_predict*.json; mocker workers,
speedup 3, 1024 KV blocks each, cold caches, on a 2-core machine shared with other jobs, so
single runs vary by +-20%): 32 shared 4k-token prefixes + 32-96-token suffixes, 2 workers, c=8,
five seeds: round-robin / predictive mean TTFT 1.41x, 1.36x, 1.36x, 1.28x, 1.28x, with 93-98%
of the oracle's cache hits and p90 1.02-1.23x better (Dynamo's cost: 1.07-1.18x, 74-81%, p90
0.91-0.97x; the last seeds ran with the final refit schedule, PRIOR_REFRESH);
4 workers, c=8: 1.66x, 99% (Dynamo's cost 1.33x, 86%); multi-turn chats over shared documents,
c=8: 1.75x (2 workers) and 4.07x (4 workers), 100% of the oracle's hits; c=1: the oracle's hits
on every workload; c=32, 2 workers: 1.21x (Dynamo's cost 1.06x). Where it does not win:
8 1k-token prefixes, 2 workers, c=8 (1.02x: every policy already gets 95% of the hits there).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dynamo_graph.router.kv.cost import Choice, overlap_of
from dynamo_graph.router.kv.reported import ReportedLoad
from dynamo_graph.router.kv.sequences import ActiveSequences, WorkerKey

# Features are scaled so that the normal equations stay well conditioned.
TOKEN_SCALE = 1000.0  # b is fitted per 1k tokens
BLOCK_SCALE = 100.0  # c per 100 blocks
# Default coefficients, before any observation: 20 ms per pass, 50 ms per 1k prefill tokens,
# 1 ms per 100 held blocks: a mid-size model on one GPU, so tokens to compute dominate.
DEFAULT_COEFFS = (0.020, 0.050 / TOKEN_SCALE, 0.001 / BLOCK_SCALE)
# How much a prior counts, in observations' worth (per coefficient).
PRIOR_WEIGHT = 2.0
# Weight decay per observation: the fit follows about the last 1/(1-DECAY) = 50 requests.
DECAY = 0.98
# Every this many observations, all ranks' fits are re-solved against the moved pooled prior.
PRIOR_REFRESH = 16
# A deeper prefix holder wins when its prediction is at most this much worse than the best.
TIE_TOLERANCE = 0.10


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting for a 3x3 system; None when singular."""
    a = [[*row, rhs] for row, rhs in zip(m, v, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    return x[0], x[1], x[2]


class TtftFit:
    """Exponentially weighted least squares of ttft ~ a + b * tokens + c * blocks, shrunk
    towards a prior (ridge), with b and c kept non-negative."""

    __slots__ = ("_xtx", "_xty", "coeffs", "observations")

    def __init__(self) -> None:
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self.observations = 0
        self.coeffs: tuple[float, float, float] = DEFAULT_COEFFS  # a, b per token, c per block

    def observe(self, tokens: float, blocks: float, seconds: float) -> None:
        phi = (1.0, tokens / TOKEN_SCALE, blocks / BLOCK_SCALE)
        xtx, xty = self._xtx, self._xty
        for i in range(3):
            row = xtx[i]
            for j in range(3):
                row[j] = DECAY * row[j] + phi[i] * phi[j]
            xty[i] = DECAY * xty[i] + phi[i] * seconds
        self.observations += 1

    def refit(self, prior: tuple[float, float, float]) -> None:
        """Solve (X'WX + P) theta = X'Wy + P prior, in scaled units (without data: the prior)."""
        if not self.observations:
            self.coeffs = prior
            return
        scaled = (prior[0], prior[1] * TOKEN_SCALE, prior[2] * BLOCK_SCALE)
        m = [[*row] for row in self._xtx]
        v = [*self._xty]
        for i in range(3):
            m[i][i] += PRIOR_WEIGHT
            v[i] += PRIOR_WEIGHT * scaled[i]
        solved = _solve3(m, v)
        if solved is None:
            return
        a, b, c = solved
        self.coeffs = (max(a, 0.0), max(b, 0.0) / TOKEN_SCALE, max(c, 0.0) / BLOCK_SCALE)

    def predict(self, tokens: float, blocks: float) -> float:
        a, b, c = self.coeffs
        return a + b * tokens + c * blocks


@dataclass(slots=True)
class _Pending:
    key: WorkerKey
    tokens: int
    blocks: int
    started: float


class TtftModel:
    """Per-rank TTFT fits, the pooled fit they lean on, and the requests waiting to be observed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.fits: dict[WorkerKey, TtftFit] = {}
        self.pooled = TtftFit()
        self.reported = ReportedLoad(clock=clock)  # the workers' load metrics
        self._pending: dict[str, _Pending] = {}
        self._clock = clock

    def fit(self, key: WorkerKey) -> TtftFit:
        fit = self.fits.get(key)
        if fit is None:
            fit = self.fits[key] = TtftFit()
            fit.coeffs = self._untried_coeffs()
        return fit

    def _untried_coeffs(self) -> tuple[float, float, float]:
        """What a rank predicts before its first observation: the least of each coefficient
        over the pool and the observed ranks (see the module docstring)."""
        observed = [fit.coeffs for fit in self.fits.values() if fit.observations]
        a, b, c = zip(self.pooled.coeffs, *observed, strict=True)
        return min(a), min(b), min(c)

    def decode_blocks(self, key: WorkerKey, booked: int) -> int:
        """KV blocks `key` holds: the router's `booked` or the rank's report, the larger."""
        return max(booked, self.reported.blocks(key))

    def queued_tokens(self, key: WorkerKey, booked: int) -> int:
        """Prefill tokens queued on `key`: the router's `booked` or the rank's report, the larger."""
        return max(booked, self.reported.prefill_tokens(key))

    def started(self, request_id: str, key: WorkerKey, tokens: int, blocks: int) -> None:
        """A request was routed to `key` with `tokens` prefill tokens ahead of and in it."""
        self._pending[request_id] = _Pending(key, tokens, blocks, self._clock())

    def first_token(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        seconds = self._clock() - pending.started
        self.observe(pending.key, pending.tokens, pending.blocks, seconds)

    def observe(self, key: WorkerKey, tokens: int, blocks: int, seconds: float) -> None:
        """One observed TTFT: into the pooled fit and `key`'s, whose fit is re-solved against
        the pooled prior, as are the fits of ranks with fewer than `PRIOR_REFRESH` observations
        (they follow the pool); the pool itself and the other ranks every `PRIOR_REFRESH`
        observations, not every time, which would cost a solve per rank per request."""
        pooled = self.pooled
        pooled.observe(tokens, blocks, seconds)
        everyone = pooled.observations % PRIOR_REFRESH == 0
        if everyone or pooled.observations < PRIOR_REFRESH:  # the pool moves slowly
            pooled.refit(DEFAULT_COEFFS)
        observed = self.fit(key)
        observed.observe(tokens, blocks, seconds)
        untried = []
        for fit in self.fits.values():
            # Ranks that have seen little lean on the pool and follow it at once; the rest
            # (whose own data outweighs the prior) on their own observations and now and then.
            if not fit.observations:
                untried.append(fit)
            elif everyone or fit is observed or fit.observations < PRIOR_REFRESH:
                fit.refit(pooled.coeffs)
        if untried:
            coeffs = self._untried_coeffs()
            for fit in untried:
                fit.coeffs = coeffs

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self.fits if k[0] == worker_id]:
            del self.fits[key]
        self.reported.remove_worker(worker_id)

    def backlog_seconds(self, key: WorkerKey, sequences: ActiveSequences) -> float:
        """Predicted time until the prefill work already routed to `key` is done."""
        tokens = self.queued_tokens(key, sequences.prefill_tokens(key))
        if not tokens:
            return 0.0
        blocks = self.decode_blocks(key, sequences.active_blocks(key))
        return self.fit(key).predict(tokens, blocks)


def predict_workers(
    candidates: Sequence[WorkerKey],
    seq_hashes: Sequence[int],
    isl: int,
    block_size: int,
    indexed_overlap: Mapping[WorkerKey, int],
    sequences: ActiveSequences,
    model: TtftModel,
    prefill_penalty: float = 0.0,
    spare_blocks: Callable[[WorkerKey], int | None] | None = None,
) -> list[Choice]:
    """Each candidate's predicted TTFT (seconds), plus `prefill_penalty` times the prefill time
    of the work the request adds there beyond its own wait (see the module docstring): its
    uncached tokens, and the cached blocks they evict where `spare_blocks` (free cache blocks of
    a rank, None when unknown) is short."""
    choices = []
    loads = sequences.loads
    per_token = model.pooled.coeffs[1]
    for key in candidates:
        load = loads.get(key)
        overlap, _ = overlap_of(key, seq_hashes, indexed_overlap, sequences)
        new_tokens = max(isl - overlap * block_size, 0)
        queued = model.queued_tokens(key, load.prefill_tokens if load is not None else 0)
        blocks = model.decode_blocks(key, len(load.blocks) if load is not None else 0)
        cost = model.fit(key).predict(queued + new_tokens, blocks)
        if prefill_penalty and new_tokens:
            added = new_tokens
            spare = spare_blocks(key) if spare_blocks is not None else None
            if spare is not None:
                added += block_size * max(-(-new_tokens // block_size) - spare, 0)
            cost += prefill_penalty * per_token * added
        choices.append(Choice(key, overlap, new_tokens, cost))
    return choices


def pick_near_best(
    choices: Sequence[Choice],
    rng: random.Random,
    tree_size: Callable[[WorkerKey], int] | None = None,
    tolerance: float = TIE_TOLERANCE,
) -> Choice:
    """The pick at temperature 0. Predictions within `tolerance` of the best count as tied
    (two fits never agree exactly, and the model is not that precise): among them the rank
    holding the deepest prefix, then the smallest cache (so idle workers share new prefixes),
    then at random."""
    best = min(c.logit for c in choices)
    limit = best + abs(best) * tolerance
    near = [c for c in choices if c.logit <= limit]
    deepest = max(c.overlap_blocks for c in near)
    near = [c for c in near if c.overlap_blocks == deepest]
    if len(near) > 1 and tree_size is not None:
        sizes = [tree_size(c.key) for c in near]
        smallest = min(sizes)
        near = [c for c, size in zip(near, sizes, strict=True) if size == smallest]
    if len(near) > 1:
        top = min(c.logit for c in near)
        lowest = [c for c in near if c.logit == top]
        return lowest[0] if len(lowest) == 1 else rng.choice(lowest)
    return near[0]
