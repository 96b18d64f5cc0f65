"""What autoscaling buys: one load profile (open-loop streamed requests, low -> high -> low) against
the same mocker pool three ways — `autoscale` between min and max replicas, static at min, static
at max — compared on SLA attainment, TTFT/ITL p90, replica-seconds and lost requests. The work is
`dyngraph bench GRAPH --profile ... --compare-static MIN,MAX` (dynamo_graph/bench/autoscale.py);
this script only writes the graph and asks for it.

The mocker (`max_num_seqs: 2`, 60-token answers at speedup 1) makes a replica serve about 4
requests/s within a 250 ms TTFT target, so the profile's high phase needs about four.

    python benchmarks/bench_autoscale.py [--model .cache/tiny-model] [--profile 6:2,30:16,24:2]
        [--target-ms 250] [--min 1] [--max 4] [--router round-robin|random|kv]
        [--out benchmarks/results/autoscale]
Results: OUT/sweep.json (the comparison under each variant's `comparison`), OUT/autoscale.png
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-model"


def graph(model: Path, args: argparse.Namespace) -> dict:
    autoscale = {
        "min_replicas": args.min,
        "max_replicas": args.max,
        "target": {"ttft_p90_ms": args.target_ms},
        "interval_s": args.interval_s,
        "scale_down_delay_s": args.scale_down_delay_s,
    }
    backend = {
        "kind": "worker",
        "model": MODEL,
        "engine": "mocker",
        "replicas": args.min,
        "engine_args": {"max_num_seqs": 2, "speedup_ratio": 1.0},
        "autoscale": autoscale,
    }
    return {
        "name": "bench-autoscale",
        "models": {MODEL: {"path": str(model)}},
        "components": {
            "frontend": {"kind": "frontend", "http": {"port": "auto"}, "router": {"mode": args.router}},
            "backend": backend,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=Path(os.environ.get("DYNGRAPH_TINY_MODEL", ROOT / ".cache/tiny-model"))
    )
    parser.add_argument("--profile", default="6:2,30:16,24:2", help="SECONDS:RATE and SECONDS:FROM-TO, ...")
    parser.add_argument("--target-ms", type=float, default=250.0)
    parser.add_argument("--min", type=int, default=1)
    parser.add_argument("--max", type=int, default=4)
    parser.add_argument("--router", default="round-robin", choices=("round-robin", "random", "kv"))
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--scale-down-delay-s", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/autoscale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        file = Path(tmp) / "graph.yaml"
        file.write_text(yaml.safe_dump(graph(args.model.resolve(), args), sort_keys=False))
        command = [
            *(sys.executable, "-m", "dynamo_graph", "bench", str(file)),
            *("--profile", args.profile, "--compare-static", f"{args.min},{args.max}"),
            *("--api", "chat", "--input-len", "16", "--output-len", "60", "--out", str(args.out)),
        ]
        sys.exit(subprocess.run(command, check=False).returncode)


if __name__ == "__main__":
    main()
