"""Micro-benchmark of the KV router's indexers on one core: KV events applied per second (in
blocks stored or removed), find_matches per second and its latency for 4k-token prompts, the
two interleaved (combined operations per second, an operation being one block stored or removed
or one find_matches, as Dynamo's Flash Indexer counts them), and the cost of hashing a prompt.

Workload (generated before anything is timed): 8 worker ranks, each simulating a prefix cache of
16 384 blocks with LRU eviction (like the mocker / vLLM); requests are one of 64 shared prefixes
(4-32 blocks: system prompts, documents) plus their own blocks (16-64 blocks in all), sent to the
prefix's usual worker 60% of the time; each request's new blocks are published as stored events
of up to 16 blocks (parent = the previous block), evictions as removed events of up to 32 blocks.
Half the workers name blocks with opaque ids (as vLLM does), half with our sequence hashes (as
the mocker does). Lookups are 64-block prompts (block size 64): 40% earlier requests continued
with new blocks (deep hits), 30% a shared prefix and new blocks (shallow hits), 30% misses; a
pool of 10 000 such prompts is cycled.

    .venv/bin/python benchmarks/bench_indexer.py [--quick] [--blocks N] [--lookups N]
Writes benchmarks/results/indexer.json (not with --quick). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynamo_graph.router.kv.approx import ApproxKvIndexer  # noqa: E402
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes  # noqa: E402
from dynamo_graph.router.kv.indexer import KvIndexer  # noqa: E402
from dynamo_graph.router.kv.protocols import KvCacheEvent, KvRemoved, KvStored, StoredBlock  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "indexer.json"
BLOCK_SIZE = 64
PROMPT_BLOCKS = 64  # 4096 tokens
CACHE_BLOCKS = 16_384
FAMILIES = 64
STORE_CHUNK = 16
REMOVE_CHUNK = 32
POOL = 10_000
RECENT = 2_000  # requests that lookups continue: about the last 1/3 of the 8 caches
_OPAQUE = 0x9E3779B97F4A7C15


class SimWorker:
    """A worker rank's prefix cache (LRU) and the KV events it publishes."""

    def __init__(self, worker_id: int, opaque: bool) -> None:
        self.worker_id = worker_id
        self.opaque = opaque
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.next_id = 0

    def block_id(self, seq: int) -> int:
        return seq ^ _OPAQUE if self.opaque else seq

    def event(self, data: KvStored | KvRemoved) -> KvCacheEvent:
        self.next_id += 1
        return KvCacheEvent(self.next_id, self.worker_id, data)

    def serve(self, local: list[int], seq: list[int], out: list[KvCacheEvent]) -> tuple[int, int]:
        """Run one request: store its uncached blocks, evict LRU past capacity. -> (stored, removed)"""
        cache = self.cache
        new = [i for i, s in enumerate(seq) if s not in cache]
        stored = 0
        # Cached prefixes stay cached in vLLM, so the new blocks are a suffix (after an eviction in
        # the middle the rest is recomputed and stored again: store from the first missing block).
        if new:
            first = new[0]
            for start in range(first, len(seq), STORE_CHUNK):
                stop = min(start + STORE_CHUNK, len(seq))
                blocks = [StoredBlock(self.block_id(seq[i]), local[i]) for i in range(start, stop)]
                parent = self.block_id(seq[start - 1]) if start else None
                out.append(self.event(KvStored(blocks, parent)))
                stored += stop - start
        for s in reversed(seq):  # freed tail first: the prefix is the most recently used
            cache[s] = None
            cache.move_to_end(s)
        removed = 0
        while len(cache) > CACHE_BLOCKS:
            victims = []
            while len(cache) > CACHE_BLOCKS and len(victims) < REMOVE_CHUNK:
                victims.append(self.block_id(cache.popitem(last=False)[0]))
            out.append(self.event(KvRemoved(victims)))
            removed += len(victims)
        return stored, removed


def generate(target_blocks: int, workers: int, lookups_pool: int, seed: int = 0):
    rng = random.Random(seed)
    rand = rng.getrandbits
    families = []
    for _ in range(FAMILIES):
        local = [rand(64) for _ in range(rng.randint(4, 32))]
        families.append((local, sequence_hashes(local)))
    sims = [SimWorker(0x1000 + w, opaque=w % 2 == 1) for w in range(workers)]
    home = [rng.randrange(workers) for _ in range(FAMILIES)]
    events: list[KvCacheEvent] = []
    recent: list[tuple[int, list[int]]] = []  # (family, own local hashes) of recent requests
    stored = removed = 0
    while stored < target_blocks:
        f = rng.randrange(FAMILIES)
        f_local, f_seq = families[f]
        total = rng.randint(max(16, len(f_local) + 1), PROMPT_BLOCKS)
        own = [rand(64) for _ in range(total - len(f_local))]
        local = f_local + own
        seq = f_seq + sequence_hashes(own, f_seq[-1])
        w = home[f] if rng.random() < 0.6 else rng.randrange(workers)
        s, r = sims[w].serve(local, seq, events)
        stored += s
        removed += r
        recent.append((f, own))
        if len(recent) > 4 * lookups_pool:
            del recent[: 2 * lookups_pool]
    prompts: list[tuple[list[int], list[int]]] = []
    for _ in range(lookups_pool):
        kind = rng.random()
        if kind < 0.4:  # a recent request (most are still cached), continued
            f, own = rng.choice(recent[-RECENT:])
            local = families[f][0] + own
        elif kind < 0.7:  # a shared prefix, new blocks
            local = list(families[rng.randrange(FAMILIES)][0])
        else:
            local = []
        local = local + [rand(64) for _ in range(PROMPT_BLOCKS - len(local))]
        prompts.append((local, sequence_hashes(local)))
    return events, prompts, stored, removed


def percentile(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=1_000_000, help="stored blocks to generate")
    parser.add_argument("--lookups", type=int, default=100_000, help="find_matches calls")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="100k blocks, 10k lookups; no JSON written")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.lookups = 100_000, 10_000
    pool = min(POOL, args.lookups)

    t0 = time.perf_counter()
    events, prompts, n_stored, n_removed = generate(args.blocks, args.workers, pool)
    gen_s = time.perf_counter() - t0
    n_blocks = n_stored + n_removed
    gc.collect()
    gc.freeze()  # the pre-generated workload is not the indexer's garbage to scan
    hits = 0

    # 1. events alone
    idx = KvIndexer()
    apply = idx.apply_event
    t0 = time.perf_counter()
    for event in events:
        apply(event)
    events_s = time.perf_counter() - t0
    assert idx.stats.parent_not_found == 0 and idx.stats.block_not_found == 0, idx.stats

    # 2. lookups alone (throughput), then latency per call
    find = idx.find_matches
    schedule = [prompts[i % pool] for i in range(args.lookups)]
    t0 = time.perf_counter()
    for local, seq in schedule:
        find(local, seq)
    lookups_s = time.perf_counter() - t0
    latencies = []
    clock = time.perf_counter_ns
    for local, seq in schedule:
        start = clock()
        found = find(local, seq)
        latencies.append((clock() - start) / 1000)
        hits += bool(found)
    latencies.sort()
    depths = [max(find(local, seq).values(), default=0) for local, seq in prompts]

    # 3. interleaved, on a fresh index: the lookups spread evenly over the event stream
    idx2 = KvIndexer()
    apply, find = idx2.apply_event, idx2.find_matches
    every = max(1, len(events) // args.lookups)
    lookups_left = iter(schedule)
    done = 0
    t0 = time.perf_counter()
    for i, event in enumerate(events):
        apply(event)
        if i % every == 0:
            local, seq = next(lookups_left, (None, None))
            if seq is not None:
                find(local, seq)
                done += 1
    combined_s = time.perf_counter() - t0

    # 4. hashing a 4k-token prompt (the router does this once per request)
    rng = random.Random(1)
    tokens = [rng.randrange(128_000) for _ in range(BLOCK_SIZE * PROMPT_BLOCKS)]
    rounds = 2000
    t0 = time.perf_counter()
    for _ in range(rounds):
        local_block_hashes(tokens, BLOCK_SIZE)
    local_us = (time.perf_counter() - t0) / rounds * 1e6
    local = local_block_hashes(tokens, BLOCK_SIZE)
    t0 = time.perf_counter()
    for _ in range(rounds):
        sequence_hashes(local)
    seq_us = (time.perf_counter() - t0) / rounds * 1e6

    # 5. the approximate indexer: record the pool's prompts, then look them up
    approx = ApproxKvIndexer()
    workers = [(0x1000 + w, 0) for w in range(args.workers)]
    t0 = time.perf_counter()
    for i, (local, seq) in enumerate(prompts):
        approx.record_routing(workers[i % args.workers], local, seq)
    record_s = time.perf_counter() - t0
    find = approx.find_matches
    t0 = time.perf_counter()
    for local, seq in schedule:
        find(local, seq)
    approx_find_s = time.perf_counter() - t0
    gc.unfreeze()

    report = {
        "benchmark": "bench_indexer",
        "workers": args.workers,
        "block_size": BLOCK_SIZE,
        "prompt_blocks": PROMPT_BLOCKS,
        "cache_blocks_per_worker": CACHE_BLOCKS,
        "events": len(events),
        "blocks_stored": n_stored,
        "blocks_removed": n_removed,
        "index_distinct_blocks": len(idx),
        "index_entries": idx.entries,
        "generate_s": round(gen_s, 2),
        "events_per_s": round(len(events) / events_s),
        "event_blocks_per_s": round(n_blocks / events_s),
        "find_matches": args.lookups,
        "find_matches_hit_ratio": round(hits / args.lookups, 3),
        "find_matches_mean_depth": round(sum(depths) / len(depths), 1),
        "find_matches_per_s": round(args.lookups / lookups_s),
        "find_matches_p50_us": round(percentile(latencies, 0.5), 2),
        "find_matches_p99_us": round(percentile(latencies, 0.99), 2),
        "combined_ops": n_blocks + done,
        "combined_ops_per_s": round((n_blocks + done) / combined_s),
        "combined_ops_per_s_from_phases": round((n_blocks + args.lookups) / (events_s + lookups_s)),
        "hash_4k_prompt_local_us": round(local_us, 1),
        "hash_4k_prompt_sequence_us": round(seq_us, 1),
        "hash_4k_prompt_total_us": round(local_us + seq_us, 1),
        "approx_record_routing_per_s": round(len(prompts) / record_s),
        "approx_record_routing_blocks_per_s": round(len(prompts) * PROMPT_BLOCKS / record_s),
        "approx_find_matches_per_s": round(args.lookups / approx_find_s),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    rows = [
        ("events applied", f"{report['events_per_s']:,}/s", f"{report['event_blocks_per_s']:,} blocks/s"),
        (
            "find_matches (64 blocks)",
            f"{report['find_matches_per_s']:,}/s",
            f"p50 {report['find_matches_p50_us']} µs, p99 {report['find_matches_p99_us']} µs",
        ),
        (
            "combined (interleaved)",
            f"{report['combined_ops_per_s']:,} ops/s",
            f"{report['combined_ops']:,} ops",
        ),
        (
            "hash a 4k-token prompt",
            f"{report['hash_4k_prompt_total_us']} µs",
            f"local {local_us:.1f} + sequence {seq_us:.1f} µs",
        ),
        (
            "approx record_routing",
            f"{report['approx_record_routing_per_s']:,}/s",
            f"{report['approx_record_routing_blocks_per_s']:,} blocks/s",
        ),
        ("approx find_matches", f"{report['approx_find_matches_per_s']:,}/s", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(
        f"{len(events):,} events ({n_stored:,} blocks stored, {n_removed:,} removed) over "
        f"{args.workers} workers; {args.lookups:,} lookups, hit ratio {report['find_matches_hit_ratio']}"
    )
    for name, rate, detail in rows:
        print(f"  {name:<{width}}  {rate:>18}  {detail}")
    if not args.quick:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
