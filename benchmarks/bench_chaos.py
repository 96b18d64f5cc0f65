"""The chaos run as a benchmark: mocker workers killed with -9 at random under streaming load
(and restarted at once, as the supervisor does), with and without request migration, against
an undisturbed run of the same load. Prints the figures and writes benchmarks/results/chaos.json.

    .venv/bin/python benchmarks/bench_chaos.py [--concurrency 200] [--duration 30] [--kill-every 2]
        [--max-tokens 64] [--workers 3] [--limit 3] [--speedup 0.25] [--out benchmarks/results/chaos.json]

Figures per run: requests, kills, migrations, completed / failed (clean: an error event or a 5xx
with an OpenAI error body; unclean: anything else), p50/p99 TTFT and end-to-end latency of the
completed requests. Dynamo's reference (PR #1424): killing one of two workers failed 32 of 100
requests before downed-instance tracking, ~0 after; the target here is 0 with migration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.*

from dynamo_graph.dev.tiny_model import ensure_tiny_model
from tests.support.chaos import ChaosConfig, run_chaos, run_load, undisturbed_usage
from tests.support.mocker_cluster import start_cluster

RESULTS = Path(__file__).with_name("results") / "chaos.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--speedup", type=float, default=0.25)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--skip-limit-zero", action="store_true", help="no run without migration")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cfg = ChaosConfig(
        workers=args.workers,
        concurrency=args.concurrency,
        duration_s=args.duration,
        kill_every_s=args.kill_every,
        max_tokens=args.max_tokens,
        prompts=args.prompts,
    )
    model_dir = Path(
        os.environ.get("DYNGRAPH_TINY_MODEL") or Path(tempfile.gettempdir()) / "dyngraph-tiny-model"
    )
    model = ensure_tiny_model(model_dir)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        (Path(tmp) / "migrating").mkdir()
        cluster = start_cluster(
            Path(tmp) / "migrating", model, workers=cfg.workers, limit=args.limit, speedup=args.speedup
        )
        try:
            quiet, chaos = run_chaos(cluster, cfg)
        finally:
            cluster.stop()
        runs["undisturbed"] = quiet.as_dict()
        runs[f"chaos_limit_{args.limit}"] = chaos.as_dict()
        _show("undisturbed", quiet.as_dict())
        _show(f"chaos, migration limit {args.limit}", chaos.as_dict())
        if not args.skip_limit_zero:
            (Path(tmp) / "limit0").mkdir()
            cluster = start_cluster(
                Path(tmp) / "limit0", model, workers=cfg.workers, limit=0, speedup=args.speedup
            )
            try:
                reference = undisturbed_usage(cluster, cfg)
                zero, _ = run_load(cluster, cfg, reference=reference)
            finally:
                cluster.stop()
            runs["chaos_limit_0"] = zero.as_dict()
            _show("chaos, migration limit 0", zero.as_dict())
    result = {
        "benchmark": "chaos",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "config": {**asdict(cfg), "migration_limit": args.limit, "mocker_speedup_ratio": args.speedup},
        "command": ".venv/bin/python benchmarks/bench_chaos.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k not in ("out", "skip_limit_zero")
        ),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _show(name: str, run: dict) -> None:
    print(
        f"{name:34s} requests {run['requests']:5d}  kills {run['kills']:3d}"
        f"  migrations {run['migrations']:4d}  completed {run['completed']:5d}"
        f"  failed clean {run['failed_clean']:4d}"
        f"  unclean {run['failed_unclean']:3d}  wrong usage {run['wrong_usage']:3d}\n"
        f"{'':34s} TTFT p50 {run['ttft_p50_s'] * 1e3:7.1f} ms  p99 {run['ttft_p99_s'] * 1e3:7.1f} ms"
        f"   latency p50 {run['latency_p50_s']:6.2f} s  p99 {run['latency_p99_s']:6.2f} s"
        f"  (wall {run['wall_s']} s)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
