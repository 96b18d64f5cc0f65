"""`dyngraph bench`: its command line. The work is in dynamo_graph/bench/ (imported when it runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from dynamo_graph.cli.problems import graph_problems

HELP = (
    "Load a running graph (or --url) and report TTFT / ITL / end-to-end percentiles, requests/s and "
    "tokens/s as a table, JSON and plots; --sweep brings the graph up under each override in turn, "
    "--compare-static its autoscale against static replica counts under one load (e.g. a --profile)."
)


def _levels(text: str | None, what: str, cast: type) -> list:
    if not text:
        return []
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"a comma list of numbers, not {text!r}", param_hint=what) from None
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter(f"numbers above 0, not {text!r}", param_hint=what)
    return values


def bench_command(
    graph_file: Annotated[Path | None, typer.Argument(help="the graph YAML file (or give --url)")] = None,
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Hydra-style overrides of the graph: key=value")
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="a running frontend: http://HOST:PORT or http://HOST:PORT/v1")
    ] = None,
    concurrency: Annotated[
        str | None, typer.Option("--concurrency", "-c", help="closed loop: users at once, e.g. 1,8,32")
    ] = None,
    rate: Annotated[
        str | None, typer.Option("--rate", "-r", help="open loop: requests/s (Poisson arrivals), e.g. 2,5")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace", help="mooncake-style JSONL: timestamp (ms), input_length, output_length, hash_ids"
        ),
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            help="open loop, a load profile: SECONDS:RATE steps and SECONDS:FROM-TO ramps "
            "(a burst: a short step), e.g. 6:2,9:2-16,20:16,10:2",
        ),
    ] = None,
    compare_static: Annotated[
        str | None,
        typer.Option(
            "--compare-static",
            help="N,M: the graph's autoscale against its autoscaled pools fixed at N, M replicas, "
            "each brought up in turn: SLA attainment, TTFT/ITL p90, replica-seconds, lost requests",
        ),
    ] = None,
    trace_speedup: Annotated[
        float, typer.Option("--trace-speedup", help="replay the trace N x faster")
    ] = 1.0,
    trace_block_size: Annotated[
        int, typer.Option("--trace-block-size", help="tokens per hash id in the trace")
    ] = 512,
    requests: Annotated[
        int | None,
        typer.Option("--requests", "-n", help="requests per load point (100; a trace: all its lines)"),
    ] = None,
    input_len: Annotated[int, typer.Option("--input-len", help="prompt tokens per request")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="tokens to generate per request")] = 64,
    prefix_len: Annotated[
        int, typer.Option("--prefix-len", help="tokens of each prompt taken from a shared prefix")
    ] = 0,
    num_prefixes: Annotated[int, typer.Option("--num-prefixes", help="distinct shared prefixes")] = 1,
    api: Annotated[
        str, typer.Option("--api", help="completions (token ids when the tokenizer is known) | chat")
    ] = "completions",
    model: Annotated[str | None, typer.Option("--model", help="served model (default: the first)")] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option("--tokenizer", help="HF model folder: token-exact prompts (a graph: its model)"),
    ] = None,
    duration: Annotated[
        float, typer.Option("--duration", help="seconds per load point after which no request starts")
    ] = 120.0,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", help="give up on one request after this many seconds")
    ] = 300.0,
    warmup: Annotated[int, typer.Option("--warmup", help="requests sent first and not measured")] = 0,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos/--stop-at-eos", help="generate exactly --output-len tokens")
    ] = True,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    reuse_prompts: Annotated[
        bool,
        typer.Option(
            "--reuse-prompts",
            help="send the same prompts at every load point (default: fresh ones per point, so "
            "no point runs on a prefix cache the points before it warmed)",
        ),
    ] = False,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            "--sweep", help="KEY=V1,V2,...: bring the graph up under each (repeatable: all combinations)"
        ),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", "-o", help="folder for JSON and plots (bench-results/NAME-TIME)")
    ] = None,
    plots: Annotated[
        bool | None,
        typer.Option("--plots/--no-plots", help="draw plots (default: when matplotlib is installed)"),
    ] = None,
    plot_format: Annotated[str, typer.Option("--plot-format", help="png | svg")] = "png",
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="DYN_API_KEY", help="bearer key for the frontend")
    ] = None,
) -> None:
    from dynamo_graph.bench.command import BenchError, Options, bench
    from dynamo_graph.bench.graphs import GraphNotReady
    from dynamo_graph.bench.measure import Load, Settings
    from dynamo_graph.bench.replicas import parse_profile
    from dynamo_graph.bench.server import ServerError

    err = Console(stderr=True, soft_wrap=True)
    if api not in ("completions", "chat"):
        raise typer.BadParameter(f"completions or chat, not {api!r}", param_hint="--api")
    loads = [Load("closed", c) for c in _levels(concurrency, "--concurrency", int)]
    loads += [Load("open", r) for r in _levels(rate, "--rate", float)]
    if trace is not None and profile is not None:
        raise typer.BadParameter(
            "a trace has its own timing: give --trace or --profile", param_hint="--profile"
        )
    if trace is not None and not loads:
        loads = [Load("trace")]
    phases: list = []
    if profile is not None:
        try:
            phases = parse_profile(profile)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--profile") from None
        loads.append(Load("profile"))
    settings = Settings(
        loads=loads or [Load("closed", 1)],
        api=api,  # type: ignore[arg-type]
        requests=requests,
        input_len=input_len,
        output_len=output_len,
        prefix_len=prefix_len,
        num_prefixes=num_prefixes,
        trace=trace,
        profile=tuple(phases),
        trace_speedup=trace_speedup,
        trace_block_size=trace_block_size,
        seed=seed,
        reuse_prompts=reuse_prompts,
        max_seconds=duration,
        request_timeout_s=request_timeout,
        warmup=warmup,
        ignore_eos=ignore_eos,
        model=model,
        tokenizer=tokenizer,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
    )
    counts = _levels(compare_static, "--compare-static", int)
    options = Options(
        graph_file, overrides or [], url, sweep or [], settings, out_dir, plots, plot_format, counts
    )
    try:
        with graph_problems(graph_file or Path("-")):
            code = bench(options, Console(soft_wrap=True), err)
    except (BenchError, ServerError, GraphNotReady) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    raise typer.Exit(code)
