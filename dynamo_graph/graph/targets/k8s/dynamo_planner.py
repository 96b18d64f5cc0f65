"""A graph's `autoscale` as Dynamo's SLA Planner service in a DynamoGraphDeployment, and back.

Dynamo's Planner (`python3 -m planner_sla`, as Dynamo's `disagg_planner.yaml` deployments run it)
sizes one prefill and one decode pool together from Prometheus metrics and the profiler's results,
so only part of `autoscale` has a spelling there: the TTFT target (the prefill pool's), the ITL
target (the decode pool's), the decode pool's KV-usage threshold (its load mode's
`--decode-kv-scale-up-threshold`), the interval, one floor for both pools (`--min-endpoint`) and
one GPU budget (`--max-gpu-budget`, our `max_gpus` or what the pools' `max_replicas` take). What
has none — aggregated pools, a per-pool ceiling, `scale_down_delay_s`, p90 rather than the
profiled latency, queue thresholds in requests or prompt tokens a replica — is returned as notes
for the DGD's header, and `import` says the same the other way.
"""

from __future__ import annotations

import math
from typing import Any

from dynamo_graph.graph.schema import Graph, Worker

MODULE = "planner_sla"
WORKING_DIR = "/workspace/components/src/dynamo/planner"
PROFILE_DIR = "/workspace/profiling_results"
PROFILE_CONFIG_MAP = "planner-profile-data"
"""Where Dynamo's deployments mount the profiler's results (a ConfigMap the profiler writes)."""
KV_FLAG = "--decode-kv-scale-up-threshold"
"""Dynamo's load mode: the decode pool's KV-cache usage (0..1) above which it grows."""
DEFAULTS = {
    "--adjustment-interval": 180,
    "--min-endpoint": 1,
    "--max-gpu-budget": 8,
    "--ttft": 500.0,
    "--itl": 50.0,
}
"""Dynamo's SLAPlannerDefaults for the flags we write (latencies in ms), what a missing flag means."""


def _pair(graph: Graph) -> tuple[dict[str, tuple[str, Worker]], list[str]]:
    """The autoscaled prefill and decode pools by role, or why the Planner cannot size them."""
    notes: list[str] = []
    scaled = {k: w for k, w in sorted(graph.workers().items()) if w.autoscale is not None}
    split = {k: w for k, w in sorted(graph.workers().items()) if w.role != "agg"}
    for key, w in scaled.items():
        if w.role == "agg":
            notes.append(
                f"components.{key}.autoscale: Dynamo's Planner sizes only disaggregated prefill and "
                f"decode pools (rendered at a fixed {w.replicas} replicas)"
            )
    pair = {w.role: (k, w) for k, w in scaled.items() if w.role != "agg"}
    if not pair:
        return {}, notes
    roles = sorted(w.role for w in split.values())
    if roles != ["decode", "prefill"] or len(pair) != 2:
        notes += [
            f"components.{k}.autoscale: Dynamo's Planner sizes one prefill and one decode pool "
            f"together; this graph has {', '.join(roles)} pools, {len(pair)} autoscaled "
            f"(rendered at a fixed {w.replicas} replicas)"
            for k, w in pair.values()
        ]
        return {}, notes
    return pair, notes


def planner_args(graph: Graph) -> tuple[list[str], list[str]]:
    """The Planner's flags for the graph's autoscaled prefill/decode pair (none: no Planner), and
    the notes on what they leave out."""
    pair, notes = _pair(graph)
    if not pair:
        return [], notes
    (pkey, prefill), (dkey, decode) = pair["prefill"], pair["decode"]
    ps, ds = prefill.autoscale, decode.autoscale
    assert ps is not None and ds is not None
    engine = decode.engine
    args = ["--environment=kubernetes", f"--backend={engine}"]
    interval = max(1, math.ceil(min(ps.interval_s, ds.interval_s)))
    args.append(f"--adjustment-interval={interval}")
    if ps.interval_s != ds.interval_s or interval != ps.interval_s:
        notes.append(
            f"components.{pkey}/{dkey}.autoscale.interval_s: {ps.interval_s}/{ds.interval_s} "
            f"(Dynamo's Planner has one interval, whole seconds: {interval})"
        )
    floor = max(ps.min_replicas, ds.min_replicas, 1)
    args.append(f"--min-endpoint={floor}")
    if ps.min_replicas != ds.min_replicas or floor != ps.min_replicas:
        notes.append(
            f"components.{pkey}/{dkey}.autoscale.min_replicas: {ps.min_replicas}/{ds.min_replicas} "
            f"(Dynamo's --min-endpoint is one floor of at least 1 for both: {floor})"
        )
    wanted = ps.max_replicas * prefill.gpus.per_replica + ds.max_replicas * decode.gpus.per_replica
    budget = min(wanted, graph.max_gpus) if graph.max_gpus is not None else wanted
    if budget:
        args.append(f"--max-gpu-budget={budget}")
    notes.append(
        f"components.{pkey}/{dkey}.autoscale.max_replicas: {ps.max_replicas}/{ds.max_replicas} "
        f"(Dynamo's Planner bounds both pools by one GPU budget: "
        + (f"--max-gpu-budget={budget})" if budget else "none, the pools declare no GPUs)")
    )
    for role, worker in (("prefill", prefill), ("decode", decode)):
        if worker.gpus.per_replica:
            args.append(f"--{role}-engine-num-gpu={worker.gpus.per_replica}")
    if ps.target.ttft_p90_ms is not None:
        args.append(f"--ttft={ps.target.ttft_p90_ms:g}")
    if ds.target.itl_p90_ms is not None:
        args.append(f"--itl={ds.target.itl_p90_ms:g}")
    if ds.target.kv_usage is not None:
        args.append(f"{KV_FLAG}={ds.target.kv_usage:g}")
    for key, name, value in (
        (pkey, "itl_p90_ms", ps.target.itl_p90_ms),
        (dkey, "ttft_p90_ms", ds.target.ttft_p90_ms),
        (pkey, "kv_usage", ps.target.kv_usage),
    ):
        if value is not None:
            notes.append(
                f"components.{key}.autoscale.target.{name}: {value:g} (Dynamo's Planner holds the "
                "prefill pool to --ttft and the decode pool to --itl and its KV usage only)"
            )
    for key, scale in ((pkey, ps), (dkey, ds)):
        for name in ("waiting_requests", "queued_prefill_tokens"):
            if (value := getattr(scale.target, name)) is not None:
                notes.append(
                    f"components.{key}.autoscale.target.{name}: {value:g} (Dynamo's load mode has "
                    "a prefill queue threshold in its own units, none per replica)"
                )
    notes.append(
        f"components.{pkey}/{dkey}.autoscale.target: Dynamo's Planner sizes by the profiler's "
        "latency curves (mount them from ConfigMap planner-profile-data), not by measured p90s"
    )
    for key, scale in ((pkey, ps), (dkey, ds)):
        notes.append(
            f"components.{key}.autoscale.scale_down_delay_s: {scale.scale_down_delay_s:g} (Dynamo's "
            "Planner sets the replicas every interval, down as well as up)"
        )
    return [*args, f"--profile-results-dir={PROFILE_DIR}"], notes


def planner_service(graph: Graph, image: str, args: list[str]) -> dict[str, Any]:
    """The Planner's DGD service: Dynamo's runtime image, its profiling results mounted."""
    volume = "planner-profile-data"
    container = {
        "image": image,
        "workingDir": WORKING_DIR,
        "command": ["python3", "-m", MODULE],
        "args": args,
        "volumeMounts": [{"name": volume, "mountPath": PROFILE_DIR, "readOnly": True}],
    }
    return {
        "dynamoNamespace": graph.namespace,
        "componentType": "planner",
        "replicas": 1,
        "extraPodSpec": {
            "mainContainer": container,
            "volumes": [{"name": volume, "configMap": {"name": PROFILE_CONFIG_MAP}}],
        },
    }


def read_planner(
    flags: list[tuple[str, str | None]], pools: dict[str, dict[str, Any]], where: str
) -> tuple[dict[str, Any], list[str]]:
    """A Planner service's flags onto the imported prefill and decode components (`pools`: role ->
    component, changed in place): their `autoscale`, and the graph's `max_gpus` (returned). Notes
    say what has no graph setting."""
    notes: list[str] = []
    given: dict[str, str | None] = {}
    for flag, value in flags:
        if flag in DEFAULTS or flag == KV_FLAG or flag.endswith("-engine-num-gpu"):
            given[flag] = value
        elif flag not in ("--environment", "--backend", "--profile-results-dir"):
            notes.append(f"{where}: planner flag {flag}{'=' + value if value else ''} has no graph setting")
    if set(pools) != {"prefill", "decode"}:
        return {}, [f"{where}: the Planner sizes a prefill and a decode pool; the DGD has no such pair"]
    for flag, default in DEFAULTS.items():
        if flag not in given:
            notes.append(f"{where}: {flag} not given; Dynamo's default {default} taken")
    value = {flag: float(given.get(flag) or default) for flag, default in DEFAULTS.items()}
    budget = int(value["--max-gpu-budget"])
    floor = int(value["--min-endpoint"])
    graph: dict[str, Any] = {"max_gpus": budget} if budget >= 0 else {}
    gpus = {role: int(comp.get("gpus", {}).get("per_replica", 0)) for role, comp in pools.items()}
    for role, comp in pools.items():
        other = "decode" if role == "prefill" else "prefill"
        room = budget - floor * gpus[other]
        ceiling = room // gpus[role] if budget >= 0 and gpus[role] else max(comp["replicas"], floor)
        ceiling = max(ceiling, comp["replicas"], floor, 1)
        target = {"ttft_p90_ms": value["--ttft"]} if role == "prefill" else {"itl_p90_ms": value["--itl"]}
        if role == "decode" and given.get(KV_FLAG):
            target["kv_usage"] = float(given[KV_FLAG] or 0)
        comp["autoscale"] = {
            "min_replicas": min(floor, comp["replicas"]),
            "max_replicas": ceiling,
            "target": target,
            "interval_s": value["--adjustment-interval"],
        }
    notes.append(
        f"{where}: one GPU budget for both pools read as max_gpus and each pool's max_replicas; "
        "targets taken as p90s (Dynamo sizes by the profiler's latency curves)"
    )
    return graph, notes
