"""Routing benchmark: random vs round-robin vs KV-aware routing over mocker workers.

    .venv/bin/python benchmarks/bench_routing.py                  # everything (~4-5 minutes)
    .venv/bin/python benchmarks/bench_routing.py --overhead-only  # the in-process router cost

Setup. For every (router mode, concurrency) point, fresh processes on 127.0.0.1 over the embedded planes (file
discovery, tcp request plane, zmq event plane): `--workers` (4) mocker workers, each its own
`dyngraph run in=dyn://bench.mocker.generate out=mocker` process, and one frontend
`dyngraph run in=http out=auto --router-mode MODE`. Modes: `random`, `round-robin`, `kv` (KV
events from the workers feed the router's indexer; the predictive cost, the default since
issue 17), `kv-dynamo` (the same with `--router-cost dynamo`, Dynamo's block cost; the figures
under "Findings" below were measured with it, before the predictive cost existed) and
`kv-approx` (`--use-kv-events false`: the router indexes its own decisions). So every point
starts with cold caches (and a cold router); starting them takes about a second. A few short
unrelated requests warm each up.

Workload (seeded, deterministic prompts): multi-turn conversations over shared documents.
`--docs` (16) documents of `--doc-tokens` (4096) random token ids, `--convs-per-doc` (4)
conversations per document (64 in all), `--turns` (8) turns each. Turn t's prompt is

    document + (user_0 + answer_0) + ... + (user_{t-1} + answer_{t-1}) + user_t

sent as token ids to /v1/completions (streamed, `ignore_eos`, usage in the last chunk), so the
prompts are exact. User turns are 32-96 ids (`--user-tokens` 64 +-50%), answers 16-48
(`--max-tokens` 32 +-50%, the request's max_tokens). answer_t is the client's own deterministic
ids: the mocker's generated ids are random, so its cached output blocks never match a later
prompt (a real engine's would; here only the prompt's full blocks are reusable). Ids are drawn
from the tiny model's ordinary vocabulary (above its special tokens). Conversations are
shuffled (seeded) and `c` of them run at once, each one's turns back to back (no think time):
concurrency c = conversations in flight. The lengths vary because with identical turns the
conversations stay in lockstep and, with c a multiple of the worker count, round-robin sends
each conversation to the same worker every turn (an accidental cache affinity that real traffic
does not have: measured at c=8 with fixed lengths, round-robin's hit rate was 0.80 vs random's
0.74). Every concurrency level draws its own documents (seed, c); every mode sees the same
prompts at a given c. c=1 runs only `--c1-conversations` (8) conversations, to bound its time.
Every point stops starting turns after `--max-seconds`.

Mocker settings (why): block_size 64; speedup_ratio 3, so a forward pass takes ~5-60 ms of wall
time (decode ~2-9 ms, a 4k-token prefill ~30 ms), well above the frontend's per-token CPU on
this 2-core machine; num_gpu_blocks 512 per worker (32k tokens); context length 16384. All the
distinct prompt blocks of a run are 16 documents x 64 blocks + 64 conversations x ~11 history
blocks ~= 1,730 (+ <= 256 never-reused answer blocks): ~3.9x one worker's cache, ~97% of four.
What must stay cached at once at c=8 (the in-flight conversations' documents and histories,
plus the documents whose other conversations come later) is ~600-1,100 blocks: more than one
worker holds, well within four. That is the case where cache-aware routing pays: spread evenly,
every worker sees every document and its LRU thrashes; routed by prefix, each worker holds about
a quarter of the documents. Documents are 4k tokens (not 2k) because under the mocker's perf
model a forward pass costs 16.5 ms + decode (~15 ms at these loads) before any prompt token:
with 2k-token documents a miss cost only ~1.7x a hit at c=8 (TTFT p50 ~25 vs ~14 ms), which
bounds what any routing can gain there (measured: round-robin/kv TTFT p50 1.05, p90 1.28).

Findings (defaults; benchmarks/results/routing.json): at c=8 kv routing misses on 4.3% of
requests (hit rate 0.93; 16 of 512 requests must compute a cold document) against round-robin's
32% (0.66). Round-robin/kv TTFT at c=8: mean 1.44x, p50 1.12x, p90 1.98x; at c=32 (memory
pressure) mean 2.95x, p50 2.83x; at c=1 mean 1.65x. The p50 at c=8 stays low because a
round-robin request is still a hit more often than not, and a hit costs the same wherever it
lands (a forward pass is >= 16.5 ms in the perf model). Raising --kv-overlap-score-weight to 4
halves kv's misses but unbalances the workers (160/147/104/101 requests) and leaves TTFT
unchanged; counting the tokens to compute twice in the cost (router/kv/cost.py) cut
cold-prefix recomputation from 7.6% to 4.3% of requests and TTFT mean/p90 by 6%/18%.

Measured per (mode, c): TTFT p50/p90 (first turns and follow-up turns apart too), ITL p50
(gaps between streamed tokens), output tokens/s, requests, errors, cache hit rate =
sum(cached_tokens) / sum(prompt_tokens) from the usage chunks, requests per worker, and CPU
seconds of the frontend, the workers and this client. Ratios round-robin/kv TTFT p50 and p90
per c (target: >= 1.5 at c=8).

Router overhead (`--overhead-only`, also run at the end of a full run): a `KvRouter` in this
process (no HTTP) with 8 workers whose indexer holds a realistic cache (fed with KV events),
with 64 requests in flight; the time of route() + prefill_completed() + free() per request for
1k- and 4k-token prompts, p50/p99 in µs, and the share of it spent hashing the prompt; for the
predictive cost and Dynamo's. Target: <= 100 µs (Dynamo's Rust router: ~110 µs). Measured
(issue 17): predictive 71 / 99 µs, Dynamo's cost 33 / 76 µs in the same run (p99 102 / 157 vs
53 / 112 µs): predicting a TTFT per worker and fitting the observed one cost ~25-40 µs.

Prefix hash reuse (issue 17): each overhead prompt also goes through route() with its leading
prefix named as the frontend's segment tokenizer names a chat's cached segments (a length and a
digest of those ids), so that the router's PrefixHashCache (router/kv/prefix_hashes.py) hashes
only what follows it; the two are interleaved per request (`prefix_reuse_p50_us`,
`whole_over_reuse_p50`). Workload `chat_4k_plus_32`: a cached 4k-token document then a
32-token question, the frontend target's shape. Measured (3 runs, medians of p50s, this 2-core
machine, block size 64): chat_4k_plus_32 predictive 101.6 -> 57.9 us (1.76x), Dynamo's cost
78.7 -> 38.1 us (2.06x); where most of the prompt is new (isl_1024 / isl_4096 pools, 20-75% of
the tokens uncached) 1.03-1.06x, as only the prefix's part of the ~42 us of hashing is saved.

Results: benchmarks/results/routing.json (`--overhead-only`: routing_overhead.json).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import httpx

from dynamo_graph.bench.loadgen import Connections, Target, encode_request, send
from dynamo_graph.bench.report import write_json
from dynamo_graph.bench.stats import percentile
from dynamo_graph.bench.stream import Result
from dynamo_graph.bench.workload import vocab_range

ROOT = Path(__file__).resolve().parents[1]

TICKS = os.sysconf("SC_CLK_TCK")
ENDPOINT = "dyn://bench.mocker.generate"
MODES = {
    "random": ["--router-mode", "random"],
    "round-robin": ["--router-mode", "round-robin"],
    "kv": ["--router-mode", "kv", "--use-kv-events", "true"],  # the predictive cost (default)
    "kv-approx": ["--router-mode", "kv", "--use-kv-events", "false"],
    "kv-dynamo": ["--router-mode", "kv", "--use-kv-events", "true", "--router-cost", "dynamo"],
    # the predictive cost ranking by the request's own predicted TTFT only (before issue 27)
    "kv-own-ttft": ["--router-mode", "kv", "--use-kv-events", "true", "--router-prefill-penalty", "0"],
}


# ---- the workload ----------------------------------------------------------------------------


@dataclass
class Conversation:
    index: int
    doc: int
    prompts: list[list[int]]  # one per turn
    max_tokens: list[int]  # one per turn: the answer's length
    messages: list[list[dict]] | None = None  # sent as chats (prompts: their token ids) if given


def vary(rng: random.Random, mean: int) -> int:
    """A length uniform in [mean/2, 3*mean/2]."""
    return rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))


def make_conversations(
    args: argparse.Namespace, concurrency: int, vocab: tuple[int, int]
) -> list[Conversation]:
    """The point's conversations, shuffled: deterministic for (seed, concurrency)."""
    rng = random.Random(f"{args.seed}:{concurrency}")
    low, high = vocab

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    docs = [ids(args.doc_tokens) for _ in range(args.docs)]
    convs = []
    for doc in range(args.docs):
        for _ in range(args.convs_per_doc):
            history = list(docs[doc])
            prompts, answers = [], []
            for _turn in range(args.turns):
                history += ids(vary(rng, args.user_tokens))
                prompts.append(list(history))
                answers.append(vary(rng, args.max_tokens))
                history += ids(answers[-1])  # the client's "answer"
            convs.append(Conversation(len(convs), doc, prompts, answers))
    rng.shuffle(convs)
    return convs


# ---- the streaming client ----------------------------------------------------------------------


@dataclass
class TurnResult(Result):
    """What the client saw of one turn (dyngraph bench's per-request result), and which turn."""

    conv: int = 0
    turn: int = 0


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """A streamed /v1/completions request of token ids, usage in the last chunk."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "nvext": {"ignore_eos": True},
    }


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A streamed /v1/chat/completions request, usage in the last chunk."""
    body = {k: v for k, v in completion_body(model, [], max_tokens).items() if k != "prompt"}
    return {**body, "messages": messages}


async def run_point(
    port: int,
    model: str,
    convs: list[Conversation],
    concurrency: int,
    max_seconds: float,
    keep_alive: bool = True,
) -> tuple[list[TurnResult], float]:
    """`concurrency` conversations at once, each one's turns in order; no new turn after the
    deadline. Conversations with `messages` are sent as chats; `keep_alive=False`: a new
    connection per request."""
    chats = bool(convs) and convs[0].messages is not None
    target = Target(
        "127.0.0.1", port, "/v1/chat/completions" if chats else "/v1/completions", keep_alive=keep_alive
    )

    def body(c: Conversation, t: int) -> dict:
        if c.messages is not None:
            return chat_body(model, c.messages[t], c.max_tokens[t])
        return completion_body(model, c.prompts[t], c.max_tokens[t])

    requests = {
        (c.index, t): encode_request(target, body(c, t)) for c in convs for t in range(len(c.prompts))
    }
    queue = list(reversed(convs))
    results: list[TurnResult] = []
    start = time.perf_counter()
    deadline = time.monotonic() + max_seconds

    async def slot() -> None:
        conns = Connections(target)  # one kept-alive connection per slot
        while queue and time.monotonic() < deadline:
            conv = queue.pop()
            for turn in range(len(conv.prompts)):
                if time.monotonic() >= deadline:
                    break
                result = TurnResult(len(results), conv=conv.index, turn=turn)
                results.append(await send(conns, requests[(conv.index, turn)], result, start, 60.0))
        conns.close()

    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def summarize(results: list[TurnResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def ttft(rs: list[TurnResult], q: float) -> float:
        return round(percentile([r.ttft for r in rs], q) * ms, 2)

    first = [r for r in ok if r.turn == 0]
    # A "miss": less than half of the prompt was cached (the document had to be computed).
    misses = [r for r in ok if 2 * r.cached_tokens < r.prompt_tokens]
    hits = [r for r in ok if 2 * r.cached_tokens >= r.prompt_tokens]
    later = [r for r in ok if r.turn > 0]
    gaps = [g for r in ok for g in r.gaps]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
        "wall_s": round(wall, 2),
        "ttft_mean_ms": round(sum(r.ttft for r in ok) / len(ok) * ms, 2) if ok else 0.0,
        "ttft_p50_ms": ttft(ok, 50),
        "ttft_p90_ms": ttft(ok, 90),
        "ttft_p99_ms": ttft(ok, 99),
        "ttft_first_turn_p50_ms": ttft(first, 50),
        "ttft_follow_up_p50_ms": ttft(later, 50),
        "ttft_follow_up_p90_ms": ttft(later, 90),
        "miss_share": round(len(misses) / len(ok), 3) if ok else 0.0,
        "ttft_hit_p50_ms": ttft(hits, 50),
        "ttft_miss_p50_ms": ttft(misses, 50),
        "itl_p50_ms": round(percentile(gaps, 50) * ms, 2),
        "itl_p90_ms": round(percentile(gaps, 90) * ms, 2),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall, 1) if wall else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 3) if prompt else 0.0,
    }


# ---- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, by PID: only the processes this benchmark started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class Deployment:
    """`workers` mocker processes and one frontend in `mode`, on fresh file discovery."""

    def __init__(self, args: argparse.Namespace, mode: str, c: int, run_dir: Path) -> None:
        self.mode = mode
        self.model = Path(args.model).name
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        name = f"{mode}-c{c}"
        kv_dir = run_dir / f"kv-{name}"
        planes = {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(kv_dir),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_LEASE_TTL": "2",
        }
        engine_args = run_dir / "mocker.json"
        engine_args.write_text(json.dumps(mocker_settings(args)))
        worker_argv = [
            sys.executable, "-m", "dynamo_graph", "run", f"in={ENDPOINT}", "out=mocker",
            "--model-path", str(args.model), "--extra-engine-args", str(engine_args),
            "--context-length", str(args.context_length),
        ]  # fmt: skip
        env = {**os.environ, **planes, "DYN_LOG": "warn"}
        try:
            for i in range(args.workers):
                log = (run_dir / f"{name}-worker{i}.log").open("wb")
                self.procs.append(subprocess.Popen(worker_argv, env=env, stdout=log, stderr=log))
            router = [*MODES[mode]]
            if mode.startswith("kv"):
                router += ["--kv-overlap-score-weight", str(args.kv_overlap_score_weight)]
                router += ["--router-temperature", str(args.router_temperature)]
                router += getattr(args, "kv_router_args", [])
            frontend_argv = [
                sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=auto", *router,
                "--http-port", str(self.port),
            ]  # fmt: skip
            fenv = {**env, "DYN_LOG": "info,dynamo_graph.router=debug" if args.router_debug else "warn"}
            self.frontend_log = run_dir / f"{name}-frontend.log"
            log = self.frontend_log.open("wb")
            self.frontend = subprocess.Popen(frontend_argv, env=fenv, stdout=log, stderr=log)
            self.procs.append(self.frontend)
            self._wait_ready(args.workers, 90.0)
        except BaseException:
            self.close()
            raise

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def instances(self) -> list[dict]:
        health = httpx.get(f"{self.base_url}/health", timeout=5).json()
        details = health.get("details", {}).get(self.model)
        return details["instances"] if details else []

    def _wait_ready(self, workers: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[:6]} exited with {proc.returncode}")
            try:
                if len(self.instances()) >= workers:
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.mode}: {workers} workers not discovered after {timeout}s")

    def requests_per_instance(self) -> dict[str, int]:
        return {str(i["instance_id"]): int(i.get("requests", 0)) for i in self.instances()}

    def cpu(self) -> dict[str, float]:
        workers = sum(cpu_seconds(p.pid) for p in self.procs if p is not self.frontend)
        return {"frontend": cpu_seconds(self.frontend.pid), "workers": workers}

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)


def mocker_settings(args: argparse.Namespace) -> dict:
    settings = {
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks,
        "speedup_ratio": args.speedup_ratio,
    }
    for key in ("scheduling_policy", "max_num_batched_tokens"):  # bench_overload.py sets them
        if getattr(args, key, None) is not None:
            settings[key] = getattr(args, key)
    return settings


def warm_up(dep: Deployment, args: argparse.Namespace, vocab: tuple[int, int]) -> None:
    """A few short unrelated requests per worker (imports, connections), not measured."""
    rng = random.Random(f"{args.seed}:warm-up")
    convs = [
        Conversation(i, -1, [[rng.randrange(*vocab) for _ in range(3 * args.block_size + 5)]], [4])
        for i in range(2 * args.workers)
    ]
    asyncio.run(run_point(dep.port, dep.model, convs, args.workers, 20.0))


def run_point_fresh(
    args: argparse.Namespace, mode: str, c: int, run_dir: Path, vocab: tuple[int, int]
) -> dict:
    """One (mode, c) point on freshly started workers and frontend: every point starts cold."""
    started = time.monotonic()
    dep = Deployment(args, mode, c, run_dir)
    try:
        up = time.monotonic() - started
        warm_up(dep, args, vocab)
        convs = make_conversations(args, c, vocab)
        if c == 1:
            convs = convs[: args.c1_conversations]
        before = dep.requests_per_instance()
        cpu0, client0 = dep.cpu(), time.process_time()
        point = run_point(dep.port, dep.model, convs, c, args.max_seconds)
        results, wall = asyncio.run(point)
        cpu1, client1 = dep.cpu(), time.process_time()
        after = dep.requests_per_instance()
    finally:
        dep.close()
    row = {
        "mode": mode,
        "concurrency": c,
        "conversations": len(convs),
        **summarize(results, wall),
        "requests_per_worker": sorted((after[k] - before.get(k, 0) for k in after), reverse=True),
        "cpu_s": {
            "frontend": round(cpu1["frontend"] - cpu0["frontend"], 2),
            "workers": round(cpu1["workers"] - cpu0["workers"], 2),
            "client": round(client1 - client0, 2),
        },
        "startup_s": round(up, 1),
    }
    print(json.dumps(row), flush=True)
    return row


# ---- router overhead, in process ---------------------------------------------------------------


def measure_overhead(args: argparse.Namespace, cost: str = "predictive") -> dict:
    """route() + prefill_completed() + free() at 8 workers with a realistic index and load,
    with the router's `cost`."""
    from xxhash import xxh3_128_digest

    from dynamo_graph.router.config import RouterConfig
    from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
    from dynamo_graph.router.kv.protocols import KvCacheEvent, KvStored, StoredBlock
    from dynamo_graph.router.kv.router import KvRouter

    bs = 64
    n_workers = 8
    rng = random.Random(f"{args.seed}:overhead")
    low, high = 6, 2048
    router = KvRouter(bs, RouterConfig(cost=cost), seed=1)
    workers = [rng.getrandbits(63) for _ in range(n_workers)]

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    # The cache: a 512-token system prompt every worker holds, and 512 documents of 4k tokens
    # (system prompt + 3.5k), each cached on 2 workers: 8 x 128 x 64 = 65k (worker, block)
    # entries, half of a default mocker's 16k-block cache per worker.
    system = ids(8 * bs)
    docs = [system + ids(56 * bs) for _ in range(512)]
    event_id = 0
    for d, doc in enumerate(docs):
        local = local_block_hashes(doc, bs)
        seq = sequence_hashes(local)
        for w in (workers[d % n_workers], workers[(d * 3 + 1) % n_workers]):
            for start in range(0, len(seq), 16):  # stored events of 16 blocks, as a prefill's chunks
                pairs = zip(seq[start : start + 16], local[start : start + 16], strict=True)
                blocks = [StoredBlock(s, h) for s, h in pairs]
                parent = seq[start - 1] if start else None
                event_id += 1
                router.indexer.apply_event(KvCacheEvent(event_id, w, KvStored(blocks, parent)))

    def prompts(tokens: int, n: int) -> list[tuple[list[int], list[tuple[int, bytes]]]]:
        """Prompts, each with its leading prefix named as the segment tokenizer would (a
        cached document or system prompt: its length and a digest of its ids)."""
        out = []
        for _ in range(n):
            kind = rng.random()
            if kind < 0.5:  # continues a cached document for a while, then new tokens
                keep = rng.randrange(tokens // 4, tokens + 1)
                prompt = rng.choice(docs)[:keep] + ids(tokens - keep)
            elif kind < 0.8:  # the system prompt, then new tokens
                keep = len(system)
                prompt = system + ids(tokens - len(system))
            else:  # nothing cached
                keep = 0
                prompt = ids(tokens)
            key = xxh3_128_digest(array("I", prompt[:keep]).tobytes())
            out.append((prompt, [(keep, key)] if keep else []))
        return out

    # 64 requests in flight (8 per worker on average), 2k-4k tokens, as a loaded deployment.
    for i, (prompt, _) in enumerate(prompts(4096, 64)):
        rid = f"bg{i}"
        router.route(rid, prompt[: rng.randrange(2048, 4097)], workers)
        if i % 2:
            router.prefill_completed(rid)

    out: dict = {
        "workers": n_workers,
        "block_size": bs,
        "index_entries": router.indexer.entries,
        "in_flight": len(router.sequences),
    }

    def chats(n: int) -> list[tuple[list[int], list[tuple[int, bytes]]]]:
        """A cached 4k-token document (its name: a digest of its ids) and a 32-token question."""
        out = []
        for _ in range(n):
            doc = rng.choice(docs[:32])
            out.append((doc + ids(32), [(len(doc), xxh3_128_digest(array("I", doc).tobytes()))]))
        return out

    clock = time.perf_counter_ns

    def once(rid: str, prompt: list[int], prefixes: list[tuple[int, bytes]] | None) -> float:
        t0 = clock()
        router.route(rid, prompt, workers, prefixes=prefixes)
        router.prefill_completed(rid)
        router.free(rid)
        return (clock() - t0) / 1000

    for name, pool in (
        ("isl_1024", prompts(1024, 256)),
        ("isl_4096", prompts(4096, 256)),
        ("chat_4k_plus_32", chats(256)),
    ):
        for i in range(200):  # warm-up
            router.route(f"w{i}", pool[i % len(pool)][0], workers)
            router.free(f"w{i}")
        totals, reusing, hashing = [], [], []
        gc.collect()
        for i in range(args.overhead_requests):
            prompt, prefixes = pool[i % len(pool)]
            # The same request without and with its named prefix (block hashes reused from
            # the router's prefix hash cache), in alternating order.
            if i % 2:
                reusing.append(once(f"p{i}", prompt, prefixes))
                totals.append(once(f"r{i}", prompt, None))
            else:
                totals.append(once(f"r{i}", prompt, None))
                reusing.append(once(f"p{i}", prompt, prefixes))
            t1 = clock()
            sequence_hashes(local_block_hashes(prompt, bs))
            hashing.append((clock() - t1) / 1000)
        out[name] = {
            "requests": len(totals),
            "p50_us": round(percentile(totals, 50), 1),
            "p99_us": round(percentile(totals, 99), 1),
            "hash_p50_us": round(percentile(hashing, 50), 1),
            "hash_share_p50": round(percentile(hashing, 50) / percentile(totals, 50), 2),
            "prefix_reuse_p50_us": round(percentile(reusing, 50), 1),
            "prefix_reuse_p99_us": round(percentile(reusing, 99), 1),
            "whole_over_reuse_p50": round(percentile(totals, 50) / percentile(reusing, 50), 2),
        }
    out["prefix_hash_cache"] = {
        "hits": router.prefix_hashes.hits,
        "misses": router.prefix_hashes.misses,
        "held_bytes": router.prefix_hashes.held_bytes,
    }
    return out


# ---- output ------------------------------------------------------------------------------------


def ratios(rows: list[dict], base: str = "round-robin", kv: str = "kv") -> list[dict]:
    out = []
    for row in rows:
        if row["mode"] != kv:
            continue
        ref = next((r for r in rows if r["mode"] == base and r["concurrency"] == row["concurrency"]), None)
        if ref is None or not row["ttft_p50_ms"] or not row["ttft_p90_ms"] or not row["ttft_mean_ms"]:
            continue
        out.append(
            {
                "concurrency": row["concurrency"],
                f"{base}_over_{kv}_ttft_mean": round(ref["ttft_mean_ms"] / row["ttft_mean_ms"], 2),
                f"{base}_over_{kv}_ttft_p50": round(ref["ttft_p50_ms"] / row["ttft_p50_ms"], 2),
                f"{base}_over_{kv}_ttft_p90": round(ref["ttft_p90_ms"] / row["ttft_p90_ms"], 2),
            }
        )
    return out


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="routing: multi-turn conversations over shared documents")
    columns = [
        ("mode", "mode"), ("c", "concurrency"), ("reqs", "ok"), ("err", "errors"),
        ("TTFT mean", "ttft_mean_ms"), ("TTFT p50", "ttft_p50_ms"), ("TTFT p90", "ttft_p90_ms"),
        ("1st turn p50", "ttft_first_turn_p50_ms"),
        ("follow-up p50", "ttft_follow_up_p50_ms"), ("miss share", "miss_share"),
        ("hit p50", "ttft_hit_p50_ms"), ("miss p50", "ttft_miss_p50_ms"), ("ITL p50", "itl_p50_ms"),
        ("out tok/s", "output_tokens_per_s"), ("hit rate", "cache_hit_rate"), ("wall s", "wall_s"),
    ]  # fmt: skip
    for name, _ in columns:
        table.add_column(name, justify="left" if name == "mode" else "right")
    table.add_column("reqs/worker", justify="right")
    table.add_column("CPU s fe/wk/cl", justify="right")
    for row in rows:
        cpu = row["cpu_s"]
        table.add_row(
            *(str(row[key]) for _, key in columns),
            ",".join(map(str, row["requests_per_worker"])),
            f"{cpu['frontend']}/{cpu['workers']}/{cpu['client']}",
        )
    Console(width=240).print(table)
    print("(times in ms)")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The conversations over shared documents and the mocker deployment they run on (shared
    with bench_lora_routing.py)."""
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--convs-per-doc", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=64, help="mean user turn (+-50%%)")
    parser.add_argument("--max-tokens", type=int, default=32, help="mean output tokens per turn (+-50%%)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=512, help="KV cache blocks per worker")
    parser.add_argument("--speedup-ratio", type=float, default=3.0)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--kv-overlap-score-weight", type=float, default=1.0)
    parser.add_argument("--router-temperature", type=float, default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    parser.add_argument("--modes", default="random,round-robin,kv,kv-approx")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--workers", type=int, default=4)
    add_workload_arguments(parser)
    parser.add_argument("--c1-conversations", type=int, default=8, help="conversations run at c=1")
    parser.add_argument("--max-seconds", type=float, default=35.0, help="no new turn after this, per point")
    parser.add_argument("--router-debug", action="store_true", help="frontend logs every routing decision")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (path printed)")
    parser.add_argument("--overhead-only", action="store_true")
    parser.add_argument("--no-overhead", action="store_true")
    parser.add_argument("--overhead-requests", type=int, default=3000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "routing.json"))
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")

    overhead = None
    if not args.no_overhead:
        overhead = {cost: measure_overhead(args, cost) for cost in ("predictive", "dynamo")}
    if overhead:
        print("router overhead:", json.dumps(overhead), flush=True)
    if args.overhead_only:
        path = write_json(
            Path(args.out).with_name("routing_overhead.json"),
            {
                "benchmark": "routing_overhead",
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "router_overhead": overhead,
            },
        )
        print(f"wrote {path}")
        return 0

    vocab = vocab_range(Path(args.model))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    rows: list[dict] = []
    ok = False
    try:
        for mode in modes:
            for c in args.concurrency:
                rows.append(run_point_fresh(args, mode, c, run_dir, vocab))
        ok = True
    finally:
        if args.keep_logs or not ok:
            print(f"logs: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    print_table(rows)
    ratio_rows = ratios(rows)
    for r in ratio_rows:
        print(json.dumps(r))
    convs = args.docs * args.convs_per_doc
    history_blocks = (args.turns * (args.user_tokens + args.max_tokens) - args.max_tokens) // args.block_size
    result = {
        "benchmark": "routing_multi_turn_shared_documents",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": {
            "documents": args.docs,
            "document_tokens": args.doc_tokens,
            "conversations": convs,
            "conversations_at_c1": args.c1_conversations,
            "turns": args.turns,
            "user_turn_tokens": f"uniform {args.user_tokens // 2}-{args.user_tokens * 3 // 2}",
            "answer_tokens": f"uniform {args.max_tokens // 2}-{args.max_tokens * 3 // 2} (max_tokens)",
            "prompt": "document + previous (user + answer) turns + new user turn, as token ids",
            "answers": "the client's own deterministic ids; the mocker's generated ids are random",
            "concurrency": "conversations in flight; each conversation's turns back to back",
            "seed": args.seed,
            "distinct_prompt_blocks": args.docs * args.doc_tokens // args.block_size + convs * history_blocks,
            "kv_cache_blocks_per_worker": args.num_gpu_blocks,
            "kv_cache_blocks_all_workers": args.num_gpu_blocks * args.workers,
            "miss": "a request with less than half its prompt cached (miss_share, ttft_miss_p50_ms)",
        },
        "deployment": {
            "workers": args.workers,
            "mocker": mocker_settings(args),
            "context_length": args.context_length,
            "kv_overlap_score_weight": args.kv_overlap_score_weight,
            "router_temperature": args.router_temperature,
            "max_seconds_per_point": args.max_seconds,
        },
        "target": "round-robin TTFT / kv TTFT >= 1.5 at c=8; router overhead <= 100 us (Dynamo: 110 us)",
        "rows": rows,
        "ratios": ratio_rows,
        "router_overhead": overhead,
    }
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
