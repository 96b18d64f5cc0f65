"""`dyngraph bench GRAPH|--url URL`: measure a running frontend, a running graph, or each
variant of a `--sweep`, and write JSON results, plots and a table. Returns the exit code:
0 all requests answered, 1 some failed (or a variant did not come up), 2 bad input."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dynamo_graph.bench import autoscale, graphs, plots, report, server, workload
from dynamo_graph.bench.measure import Measured, Settings, measure, prepare, progress_bar
from dynamo_graph.bench.provenance import graph_provenance, plan_hash, provenance
from dynamo_graph.graph.build import Built, build


@dataclass(frozen=True)
class Options:
    graph_file: Path | None
    overrides: list[str]
    url: str | None
    sweeps: list[str]
    settings: Settings
    out_dir: Path | None
    plots: bool | None  # None: when matplotlib is installed
    plot_format: str
    compare_static: list[int] = field(default_factory=list)  # autoscale vs these replica counts


class BenchError(Exception):
    """Bad input, found before any load is sent (exit 2)."""


def _out_dir(options: Options, name: str) -> Path:
    if options.out_dir is not None:
        return options.out_dir
    return Path("bench-results") / f"{report.slug(name)}-{time.strftime('%Y%m%d-%H%M%S')}"


def _want_plots(options: Options, err: Console) -> bool:
    if options.plot_format not in plots.FORMATS:
        raise BenchError(
            f"--plot-format must be one of {', '.join(plots.FORMATS)}, not {options.plot_format!r}"
        )
    if options.plots is False:
        return False
    try:
        plots.pyplot()
    except plots.PlotsUnavailable as e:
        if options.plots:
            raise BenchError(str(e)) from None
        err.print(f"[yellow]note:[/] no plots: {plots.EXTRA_HINT}", highlight=False)
        return False
    return True


def _tokenizer_for(built: Built, settings: Settings) -> Path | None:
    """The served model's tokenizer folder in the graph (a Hugging Face folder, or a GGUF's
    `config`), for token-exact prompts; None when the graph's model has none on this machine."""
    graph_dir = Path(built.plan.graph_file).parent
    for key, model in built.graph.models.items():
        if settings.model not in (None, key, model.name):
            continue
        for candidate in (model.config, model.path):
            if (
                candidate
                and (folder := graph_dir / candidate).is_dir()
                and (folder / "tokenizer.json").is_file()
            ):
                return folder
    return None


def _settings_for(settings: Settings, built: Built | None, err: Console) -> Settings:
    if settings.tokenizer is None and built is not None:
        settings = replace(settings, tokenizer=_tokenizer_for(built, settings))
    if settings.tokenizer is None:
        err.print(
            "[yellow]note:[/] no tokenizer: prompts are plain words, about one token each "
            "(--tokenizer MODEL_DIR makes them token-exact)",
            highlight=False,
        )
    return settings


def _finish(
    measured: Measured, meta: dict, out_dir: Path, stem: str, fmt: str | None, label: str = ""
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "dyngraph-bench", **meta, **measured.result}
    if fmt:
        title = f"{(meta.get('graph') or {}).get('name') or result['url']} {label}"
        paths = report.draw(measured, out_dir, stem, fmt, title)
        result["plots"] = [p.name for p in paths]
    measured.result = result
    return report.write_json(out_dir / f"{stem}.json", result)


def _bench_url(options: Options, err: Console, out: Console, fmt: str | None) -> int:
    assert options.url is not None
    endpoint = server.Endpoint.parse(options.url)
    settings = _settings_for(options.settings, None, err)
    prepared = prepare(settings)
    out_dir = _out_dir(options, endpoint.host)
    with progress_bar() as bar:
        measured = measure(endpoint, settings, prepared, bar)
    path = _finish(measured, {**provenance(), "graph": None}, out_dir, "result", fmt)
    report.show(out, report.table([("-", measured.result)]))
    err.print(f"wrote {path}", highlight=False)
    return 1 if measured.failed else 0


def _bench_running(options: Options, err: Console, out: Console, fmt: str | None) -> int:
    assert options.graph_file is not None
    built = build(options.graph_file, options.overrides)
    url, same = graphs.running(built)
    if not same:
        err.print(
            f"[yellow]warning:[/] the running graph differs from {options.graph_file} with these overrides "
            "(`dyngraph up` applies them); the result records the file's graph hash",
            highlight=False,
        )
    settings = _settings_for(options.settings, built, err)
    prepared = prepare(settings)
    meta = {
        **provenance(),
        "graph": {**graph_provenance(built.plan, options.overrides), "matches_running": same},
    }
    with progress_bar() as bar:
        measured = measure(server.Endpoint.parse(url), settings, prepared, bar)
    path = _finish(measured, meta, _out_dir(options, built.plan.graph), "result", fmt)
    report.show(out, report.table([(built.plan.graph, measured.result)]))
    err.print(f"wrote {path}", highlight=False)
    return 1 if measured.failed else 0


def _variants(options: Options) -> tuple[list[tuple[str, list[str]]], dict[str, autoscale.Autoscale]]:
    """(label, overrides) of every variant, and the autoscaled pools a comparison samples."""
    assert options.graph_file is not None
    if not options.compare_static:
        try:
            return [(report.variant_label(v), v) for v in graphs.sweep_variants(options.sweeps)], {}
        except ValueError as e:
            raise BenchError(str(e)) from None
    if len(options.settings.loads) != 1:
        raise BenchError("--compare-static runs one load (a --profile, a --trace, one --rate or -c)")
    try:
        pools = autoscale.autoscaled(build(options.graph_file, options.overrides))
    except autoscale.CompareError as e:
        raise BenchError(str(e)) from None
    return autoscale.variants(list(pools), options.compare_static), pools


def _bench_sweep(options: Options, err: Console, out: Console, fmt: str | None) -> int:
    """A --sweep, or --compare-static: each variant brought up in turn and measured."""
    assert options.graph_file is not None
    variants, pools = _variants(options)
    # Every variant is built (and so validated) before the first one starts.
    builds = [(name, v, build(options.graph_file, [*options.overrides, *v])) for name, v in variants]
    if graphs.is_running(builds[0][2]):
        raise BenchError(
            f"graph {builds[0][2].plan.graph} is already running: a sweep brings each variant up itself "
            f"(stop it first: dyngraph down {options.graph_file})"
        )
    # ... and preflighted on its hosts: a variant that cannot start fails the sweep before any runs.
    graphs.preflight_variants([(name, built) for name, _, built in builds])
    settings = _settings_for(options.settings, builds[0][2], err)
    prepared = prepare(settings)
    out_dir = _out_dir(options, builds[0][2].plan.graph)
    done: list[tuple[str, dict]] = []
    compared: list[tuple[str, dict, list[dict]]] = []
    goal = autoscale.targets(pools)
    summary = {"benchmark": "dyngraph-bench-sweep", **provenance(), "sweep": options.sweeps, "variants": []}
    code = 0
    for number, (name, overrides, built) in enumerate(builds, 1):
        err.print(f"[bold]variant {escape(name)}[/]: bringing the graph up", highlight=False)
        entry = {"label": name, "overrides": overrides, "hash": plan_hash(built.plan)}
        try:
            with (
                graphs.brought_up(built, err) as url,
                progress_bar() as bar,
                autoscale.sampling(built, list(pools)) as samples,
            ):
                measured = measure(server.Endpoint.parse(url), settings, prepared, bar, name)
        except graphs.GraphNotReady as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
            summary["variants"].append({**entry, "error": str(e)})
            code = 1
            continue
        meta = {**provenance(), "graph": graph_provenance(built.plan, [*options.overrides, *overrides])}
        meta["variant"] = {"overrides": overrides}
        path = _finish(measured, meta, out_dir, f"v{number}-{report.slug(name)}", fmt, name)
        code = max(code, 1 if measured.failed else 0)
        done.append((name, measured.result))
        summary["variants"].append(
            {**entry, "result": path.name, "points": report.summaries(measured.result)}
        )
        if pools:
            point = measured.result["points"][0]
            summary["variants"][-1]["comparison"] = figures = autoscale.figures(point, samples, goal)
            compared.append((name, figures, point["requests"]))
    if fmt and done:
        title = f"{builds[0][2].plan.graph}: " + " x ".join(options.sweeps)
        summary["plot"] = plots.sweep_plot(done, out_dir / f"sweep.{fmt}", title).name
        if compared:
            summary["autoscale_plot"] = plots.autoscale_plot(
                compared, goal, out_dir / f"autoscale.{fmt}"
            ).name
    if pools:
        summary["compare_static"] = {"pools": list(pools), "counts": options.compare_static, "targets": goal}
    path = report.write_json(out_dir / "sweep.json", summary)
    report.show(out, report.table(done))
    if compared:
        report.show(out, autoscale.table([(n, f) for n, f, _ in compared], goal))
    err.print(f"wrote {path}", highlight=False)
    return code


def bench(options: Options, out: Console, err: Console) -> int:
    """Raises BenchError (bad input), GraphError (a graph with problems), ServerError (the
    frontend cannot be asked) or GraphNotReady (the graph is not running, or already is)."""
    if (options.graph_file is None) == (options.url is None):
        raise BenchError("give a graph file or --url URL (one of them)")
    if (options.sweeps or options.compare_static) and options.graph_file is None:
        raise BenchError("--sweep and --compare-static bring a graph up: give a graph file, not --url")
    if options.sweeps and options.compare_static:
        raise BenchError("--compare-static makes its own variants: not with --sweep")
    fmt = options.plot_format if _want_plots(options, err) else None
    try:
        if options.url is not None:
            return _bench_url(options, err, out, fmt)
        if options.sweeps or options.compare_static:
            return _bench_sweep(options, err, out, fmt)
        return _bench_running(options, err, out, fmt)
    except workload.WorkloadError as e:
        raise BenchError(str(e)) from None
