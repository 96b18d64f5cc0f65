"""Two code versions side by side in one run: the frontend's CPU per request (bench_frontend.py,
c=32, new connections and keep-alive) and `dyngraph up` to the first answer (bench_up.py),
taking turns between a baseline source tree and this one, so that both meet the same machine.

    git worktree add --detach /tmp/base <rev>
    python benchmarks/bench_versions.py --base /tmp/base [--rounds 3]
Results: benchmarks/results/versions.json, with each figure's median and its ratio to the
baseline's (below 1: the new version is cheaper or faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def _run(tree: Path, script: str, args: list[str]) -> dict:
    """One benchmark run with `tree`'s package first on the path (its own benchmark script)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--out", str(out)]
        subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def _frontend_figures(result: dict) -> dict[str, float]:
    rows = [r for r in result["rows"] if r["server"] == "dyngraph"]
    return {
        f"frontend_cpu_ms_c32_{'keep_alive' if r['keep_alive'] else 'new_conn'}": r[
            "server_cpu_ms_per_request"
        ]
        for r in rows
    }


def _up_figures(result: dict) -> dict[str, float]:
    figures = {"validate_alone_s": result["validate_alone_s"]}
    for row in result["rows"]:
        figures[f"up_first_answer_s ({row['topology']})"] = row["median_first_answer_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True, help="the baseline source tree (a git worktree)")
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "versions.json")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "new": ROOT}
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    frontend = ["--model", str(args.model), "--concurrency", "32", "--requests", str(args.requests)]
    up = ["--model", str(args.model), "--runs", "3"]
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))  # neither always goes first
        for name in order:
            figures = {
                **_frontend_figures(_run(trees[name], "bench_frontend.py", frontend)),
                **_up_figures(_run(trees[name], "bench_up.py", up)),
            }
            for key, value in figures.items():
                runs[name].setdefault(key, []).append(value)
            print(f"round {round_ + 1} {name}: {figures}", flush=True)
    medians = {name: {k: statistics.median(v) for k, v in figs.items()} for name, figs in runs.items()}
    ratios = {
        k: round(medians["new"][k] / medians["base"][k], 3) for k in medians["base"] if k in medians["new"]
    }
    result = {
        "benchmark": "two versions side by side: bench_frontend.py --concurrency 32 and bench_up.py",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {name: _git(tree) for name, tree in trees.items()},
        "rounds": args.rounds,
        "runs": runs,
        "medians": medians,
        "ratio_new_to_base": ratios,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"medians": medians, "ratio_new_to_base": ratios}, indent=2))


if __name__ == "__main__":
    main()
