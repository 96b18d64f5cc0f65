"""What a change costs the clients of a running graph: `dyngraph up -d` of an engine-args change
as a rolling update (max_surge 1, max_unavailable 0), against the same change applied the
pre-rollout way (max_surge 0, max_unavailable N: every replica stops, then all start again),
under one continuous streamed load.

A frontend (round-robin) + N mocker workers serve C closed-loop clients for the whole run
(dynamo_graph.bench's load generator: kept-alive connections, no retries, streamed chats with
`ignore_eos`). Windows, each a span of the one load:

- steady: `--steady` seconds with no change;
- rolling and baseline: from `up -d` starting to its return, `--rounds` times each (in turns,
  each toggling engine_args.num_gpu_blocks between 1024 and 2048); the figures pool the rounds.

A request counts in a window when it overlaps it. It fails when the client saw an error (HTTP
status, error event, broken stream) or fewer than max_tokens tokens. A client whose request
failed sends its next one at once, so the failure count grows with how fast failures come back;
`outage_s` (the longest time in a window without a request ending well) says how long service
was gone. After each change the load runs on for `--settle` seconds (`failed_after`). `apply_s`
is the supervisor's own time for the revision (`status --json`); the rest of `up_s` is the
CLI's (start, load, validate, compile) on a machine the load keeps busy, as `unchanged_up` (an
`up -d` that changes nothing) shows.

    python benchmarks/bench_rollout.py [--model .cache/tiny-model] [--replicas 2] [--clients 8]
        [--rounds 3] [--steady 15] [--settle 3] [--out benchmarks/results/rollout.json]
        [--hosts HOSTS.yaml | --netns-hosts N]
Results: benchmarks/results/rollout.json (rollout_ssh.json on ssh hosts)

On ssh hosts the workers are placed round-robin over them (the frontend, managed etcd and
nats-server stay here; etcd discovery, nats events): `--hosts` takes a YAML file holding a
graph's `hosts:` section (your machines), `--netns-hosts N` makes N sshd hosts in network
namespaces on this machine, as tests/system/test_remote_hosts.py does (root, iproute2,
openssh-server: `make services`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from dynamo_graph.bench.loadgen import Request, Target, run_closed
from dynamo_graph.bench.provenance import git_of, provenance
from dynamo_graph.bench.stats import percentile
from dynamo_graph.bench.stream import Result

ROOT = Path(__file__).resolve().parents[1]
DYNGRAPH = [sys.executable, "-m", "dynamo_graph"]
MODEL = "tiny-model"
MAX_REQUESTS = 100_000  # the load's bound in count; in time: LOAD_BUDGET_S
LOAD_BUDGET_S = 600.0
CLI_TIMEOUT_S = 180.0
ROLLING = {"max_surge": 1, "max_unavailable": 0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Graph:
    """The mocker graph in a temp dir (its state dir beside it), written anew before each `up`."""

    def __init__(
        self, folder: Path, model: Path, replicas: int, speedup: float, hosts: dict | None = None
    ) -> None:
        self.file = folder / "graph.yaml"
        self.port = free_port()
        self.graph: dict = {
            "name": "bench-rollout",
            "models": {MODEL: {"path": str(model)}},
            "rollout": dict(ROLLING),
            "components": {
                "frontend": {
                    "kind": "frontend",
                    "http": {"port": self.port},
                    "router": {"mode": "round-robin"},
                },
                "backend": {
                    "kind": "worker",
                    "model": MODEL,
                    "engine": "mocker",
                    "replicas": replicas,
                    "engine_args": {"num_gpu_blocks": 1024, "speedup_ratio": speedup},
                },
            },
        }
        if hosts:
            self.graph["hosts"] = hosts
            self.graph["runtime"] = {"discovery": "etcd", "request_plane": "tcp", "event_plane": "nats"}
            self.graph["infra"] = {"etcd": {"managed": True}, "nats": {"managed": True}}
            self.graph["components"]["backend"]["placement"] = [k for k in hosts if k != "local"]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*DYNGRAPH, args[0], str(self.file), *args[1:]],
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )

    def up(self) -> tuple[float, float, list[str]]:
        """Write the graph and `up -d` it: (start, end) on the perf_counter clock, and the
        processes it replaced."""
        self.file.write_text(yaml.safe_dump(self.graph, sort_keys=False))
        start = time.perf_counter()
        done = self.cli("up", "-d")
        end = time.perf_counter()
        if done.returncode != 0:
            raise SystemExit(f"up failed (rc {done.returncode}):\n{done.stdout}\n{done.stderr}")
        replaced = [line.split()[1] for line in done.stdout.splitlines() if line.strip().startswith("~ ")]
        return start, end, replaced

    def apply_s(self) -> float | None:
        """How long the supervisor took to make the serving revision ready."""
        revision = json.loads(self.cli("status", "--json").stdout).get("revision") or {}
        if revision.get("finished_at") is None:
            return None
        return round(revision["finished_at"] - revision["started_at"], 3)

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                try:
                    if client.post(url, json=body).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise SystemExit(f"the graph did not answer within {timeout_s:g} s")


@dataclass(frozen=True)
class Done:
    """One finished request, its start and end on the perf_counter clock."""

    start: float
    end: float
    result: Result


class Load:
    """`clients` closed-loop users streaming chats, on a thread of their own, until `stop()` or
    the bounds (MAX_REQUESTS, LOAD_BUDGET_S)."""

    def __init__(self, port: int, clients: int, max_tokens: int) -> None:
        self.port = port
        self.clients = clients
        self.max_tokens = max_tokens
        self.done: list[Done] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(30):
            raise SystemExit("the load did not start")

    def _record(self, result: Result) -> None:
        end = time.perf_counter()
        self.done.append(Done(end - result.total, end, result))

    def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # stop(): requests in flight are dropped
            asyncio.run(self._main())

    async def _main(self) -> None:
        target = Target("127.0.0.1", self.port, "/v1/chat/completions")
        requests = [
            Request(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"request {i}: tell me about rolling updates"}],
                    "max_tokens": self.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "nvext": {"ignore_eos": True},
                }
            )
            for i in range(MAX_REQUESTS)
        ]
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._loop.call_soon(self._started.set)
        await run_closed(
            target,
            requests,
            concurrency=self.clients,
            max_seconds=LOAD_BUDGET_S,
            request_timeout_s=60.0,
            on_result=self._record,
        )

    def check(self) -> None:
        """The load still runs (else a window would count requests it never sent)."""
        if not self._thread.is_alive():
            raise SystemExit("the load ended early: raise MAX_REQUESTS or LOAD_BUDGET_S")

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        """Until `count` more requests ended (the load flows)."""
        target = len(self.done) + count
        deadline = time.monotonic() + timeout_s
        while len(self.done) < target:
            self.check()
            if time.monotonic() > deadline:
                raise SystemExit(f"the load stalled at {len(self.done)} requests")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._loop is not None and self._task is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread.ident is not None:
            self._thread.join(timeout=30)


def figures(load: Load, spans: list[tuple[float, float]]) -> dict:
    """Figures of the requests that overlap any of `spans` (pooled)."""
    inside = [d for d in load.done if any(d.start < b and d.end > a for a, b in spans)]
    ok, failed = [], []
    for d in inside:
        (ok if d.result.ok and d.result.output_tokens == load.max_tokens else failed).append(d)
    ttfts = [d.result.ttft for d in ok]
    seconds = sum(b - a for a, b in spans)
    outage = 0.0
    for a, b in spans:
        ends = sorted([a, b, *(d.end for d in ok if a <= d.end <= b)])
        outage = max(outage, *(y - x for x, y in itertools.pairwise(ends)))
    errors: dict[str, int] = {}
    for d in failed:
        why = d.result.error or f"{d.result.output_tokens} of {load.max_tokens} tokens"
        why = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", why)[:160]  # one line per kind
        errors[why] = errors.get(why, 0) + 1
    return {
        "seconds": round(seconds, 3),
        "requests": len(inside),
        "ok": len(ok),
        "failed": len(failed),
        "ok_per_s": round(len(ok) / seconds, 2) if seconds else 0.0,
        "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 2),
        "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 2),
        "outage_s": round(outage, 3),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:6]),
    }


def apply_change(graph: Graph, load: Load, policy: dict, settle_s: float) -> dict:
    """Toggle num_gpu_blocks and `up -d` under the load with rollout `policy`; one round's row."""
    engine_args = graph.graph["components"]["backend"]["engine_args"]
    engine_args["num_gpu_blocks"] = 3072 - engine_args["num_gpu_blocks"]  # 1024 <-> 2048
    graph.graph["rollout"] = policy
    start, end, replaced = graph.up()
    apply_s = graph.apply_s()
    time.sleep(settle_s)
    load.check()
    rolled = len([n for n in replaced if n.startswith("backend-")])
    return {
        "span": (start, end),
        "num_gpu_blocks": engine_args["num_gpu_blocks"],
        "up_s": round(end - start, 3),
        "apply_s": apply_s,
        "replicas_rolled": rolled,
        "failed": figures(load, [(start, end)])["failed"],
        "failed_after": figures(load, [(end, time.perf_counter())])["failed"],
        "replaced": replaced,
    }


def summary(load: Load, rows: list[dict]) -> dict:
    """The rounds of one strategy: pooled window figures, median seconds."""
    rolled = sum(r["replicas_rolled"] for r in rows)
    up_s = round(statistics.median(r["up_s"] for r in rows), 3)
    applies = [r["apply_s"] for r in rows if r["apply_s"] is not None]
    apply_s = round(statistics.median(applies), 3) if applies else None
    per_round = rolled / len(rows)
    return {
        **figures(load, [r["span"] for r in rows]),
        "failed_after": sum(r["failed_after"] for r in rows),
        "up_s_median": up_s,
        "apply_s_median": apply_s,
        "s_per_replica": round(up_s / per_round, 3) if per_round else None,
        "apply_s_per_replica": round(apply_s / per_round, 3) if per_round and apply_s else None,
        "rounds": [{k: v for k, v in r.items() if k != "span"} for r in rows],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return float(f"{a / b:.3g}") if a is not None and b else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_model = os.environ.get("DYNGRAPH_TINY_MODEL") or ROOT / ".cache" / "tiny-model"
    parser.add_argument("--model", type=Path, default=Path(default_model))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--speedup", type=float, default=10.0, help="the mocker's speedup_ratio")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="changes per strategy, in turns")
    parser.add_argument("--steady", type=float, default=15.0, help="seconds of the steady window")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of load after each change")
    parser.add_argument(
        "--out", type=Path, default=None, help="default benchmarks/results/rollout[_ssh].json"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", type=Path, help="YAML of a graph's `hosts:` section: workers go there")
    where.add_argument("--netns-hosts", type=int, default=0, help="N sshd hosts in network namespaces here")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    args.out = args.out or results / (
        "rollout_ssh.json" if args.hosts or args.netns_hosts else "rollout.json"
    )
    model = args.model.resolve()
    if not (model / "config.json").exists():
        raise SystemExit(f"no model at {model} (set DYNGRAPH_TINY_MODEL or --model)")
    baseline_policy = {"max_surge": 0, "max_unavailable": args.replicas}
    rows: dict[str, list[dict]] = {"rolling": [], "baseline": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp, contextlib.ExitStack() as stack:
        hosts = yaml.safe_load(args.hosts.read_text()) if args.hosts else None
        if args.netns_hosts:
            sys.path.insert(0, str(ROOT))
            from tests.support.ssh_hosts import SshHosts, missing_requirements

            if why := missing_requirements():
                raise SystemExit(f"--netns-hosts: {why}")
            (Path(tmp) / "ssh").mkdir()
            made = SshHosts(Path(tmp) / "ssh", count=args.netns_hosts)
            stack.callback(made.stop)
            hosts = made.graph_hosts(Path(sys.executable).parent.parent)
        graph = Graph(Path(tmp), model, args.replicas, args.speedup, hosts)
        load = Load(graph.port, args.clients, args.max_tokens)
        try:
            graph.up()
            graph.wait_serving()
            load.start()
            load.wait_for(4 * args.clients)  # every client has had answers
            steady_from = time.perf_counter()
            time.sleep(args.steady)
            steady_span = (steady_from, time.perf_counter())
            load.check()
            start, end, replaced = graph.up()  # nothing changed: what the CLI alone costs
            noop = {"up_s": round(end - start, 3), "replaced": replaced, **figures(load, [(start, end)])}
            for round_ in range(args.rounds):
                order = ["rolling", "baseline"] if round_ % 2 == 0 else ["baseline", "rolling"]
                for name in order:
                    policy = ROLLING if name == "rolling" else baseline_policy
                    row = apply_change(graph, load, dict(policy), args.settle)
                    rows[name].append(row)
                    shown = {k: v for k, v in row.items() if k not in ("span", "replaced")}
                    print(f"round {round_ + 1} {name:8s} {json.dumps(shown)}", flush=True)
            whole = figures(load, [(load.done[0].start, time.perf_counter())])
        finally:
            load.stop()
            down = graph.cli("down")
            if down.returncode != 0:
                print(down.stdout, down.stderr, file=sys.stderr)
    steady = figures(load, [steady_span])
    rolling = summary(load, rows["rolling"])
    baseline = summary(load, rows["baseline"])
    result = {
        "benchmark": "rolling update under streamed load vs stop-all-then-start",
        **provenance(),
        "source": git_of(Path(__file__)),
        "config": {
            "graph": "frontend (router round-robin) + mocker workers; "
            + (
                f"workers on ssh hosts {graph.graph['components']['backend']['placement']}, etcd discovery, "
                "nats events, tcp request plane"
                if "hosts" in graph.graph
                else "file discovery, tcp request plane"
            ),
            "replicas": args.replicas,
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "engine_args": {"num_gpu_blocks": 1024, "speedup_ratio": args.speedup},
            "change": "engine_args.num_gpu_blocks toggled 1024 <-> 2048",
            "rolling": ROLLING,
            "baseline": baseline_policy,
            "rounds": args.rounds,
            "steady_s": args.steady,
            "settle_s": args.settle,
        },
        "wall_s": round(time.perf_counter() - started, 1),
        "steady": steady,
        "unchanged_up": noop,
        "rolling": rolling,
        "baseline": baseline,
        "whole_load": whole,
        "rolling_vs_steady": {"ttft_p99_ratio": ratio(rolling["ttft_p99_ms"], steady["ttft_p99_ms"])},
        "rolling_vs_baseline": {
            "failed_ratio": ratio(rolling["failed"], baseline["failed"]),
            "outage_s_ratio": ratio(rolling["outage_s"], baseline["outage_s"]),
            "up_s_ratio": ratio(rolling["up_s_median"], baseline["up_s_median"]),
            "apply_s_ratio": ratio(rolling["apply_s_median"], baseline["apply_s_median"]),
        },
    }
    for name in ("steady", "rolling", "baseline", "whole_load"):
        shown = {k: v for k, v in result[name].items() if k not in ("rounds", "errors")}
        print(f"{name:10s} {json.dumps(shown)}")
    print(json.dumps({k: result[k] for k in ("rolling_vs_steady", "rolling_vs_baseline")}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
