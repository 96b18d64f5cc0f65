"""The `dyngraph` command line (and `dynamo-run`, an alias of `dyngraph run`).

Thin on purpose: parse, call into the package, print. `run` takes dynamo-run's words
(`in=...`, `out=...`, a bare MODEL) and flags.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from dynamo_graph import __version__
from dynamo_graph.cli.bench import HELP as BENCH_HELP
from dynamo_graph.cli.bench import bench_command
from dynamo_graph.cli.problems import graph_problems as _graph_problems
from dynamo_graph.cli.problems import problems as _problems

if TYPE_CHECKING:  # the commands import the graph layer when they run, to start fast
    from collections.abc import Callable

    from dynamo_graph.graph.build import Built
    from dynamo_graph.graph.validate import Engines

app = typer.Typer(
    name="dyngraph",
    help="Declarative LLM serving graphs; `dyngraph run` speaks dynamo-run's command line.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
dev_app = typer.Typer(help="Developer tools.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")
keys_app = typer.Typer(help="API keys of a frontend's keys file (docs/security.md).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
err = Console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    from dynamo_graph.cli.run import fail

    fail(message)
    return typer.Exit(code)


def _explicit_flags(ctx: typer.Context) -> set[str]:
    sources = {name: ctx.get_parameter_source(name) for name in ctx.params}
    return {name for name, source in sources.items() if source is not None and source.name == "COMMANDLINE"}


def run_command(ctx: typer.Context, words: list[str] | None = None, **params: Any) -> None:
    from dynamo_graph.cli.run import execute

    code = execute(words, params, _explicit_flags(ctx))
    raise typer.Exit(code)


def _register_run_command() -> None:
    """`run`'s typer options, derived from the settings classes (process/run_config.py), so a
    setting is declared once: its flag, type, default and help come from its field."""
    from dynamo_graph.cli.run_options import run_signature

    run_command.__signature__ = run_signature()  # type: ignore[attr-defined]
    run_command.__annotations__ = {
        p.name: p.annotation for p in run_command.__signature__.parameters.values()
    }  # type: ignore[attr-defined]
    app.command(
        "run",
        context_settings={"allow_interspersed_args": True},
        help="Run a model in one process: "
        "dyngraph run in=http|text|stdin|batch:FILE|none out=ENGINE [MODEL]. "
        "Exit code 2: its settings, model, engine or port cannot be used (the message says which; "
        "run again, it fails the same way); 130: interrupted.",
    )(run_command)


_register_run_command()


def _build_or_exit(graph_file: Path, overrides: list[str] | None, engines: Engines = "dyngraph") -> Built:
    from dynamo_graph.graph.build import build

    with _graph_problems(graph_file):
        return build(graph_file, overrides or [], engines=engines)


GraphFile = Annotated[Path, typer.Argument(help="the graph YAML file")]
Overrides = Annotated[
    list[str] | None, typer.Argument(help="Hydra-style overrides: key=value, +key=value, ~key")
]


@app.command("validate", help="Check a graph file: exit 0, or 2 with every problem (file:line, key path).")
def validate_command(
    graph_file: GraphFile,
    overrides: Overrides = None,
    preflight: Annotated[
        bool,
        typer.Option(
            "--preflight", help="also check its hosts as `up` does: models, engines, env, GPUs, ports"
        ),
    ] = False,
) -> None:
    built = _build_or_exit(graph_file, overrides)
    if preflight:
        from dynamo_graph.graph.targets.local import commands
        from dynamo_graph.graph.targets.local.state import StateDir

        with _graph_problems(graph_file):  # ports a running graph holds are its own
            commands.preflight(built, check_ports=StateDir.of(graph_file).supervisor() is None)
    procs = len(built.plan.processes)
    err.print(f"{graph_file}: valid graph {built.graph.name!r}, {procs} process{'es' if procs != 1 else ''}")


@app.command("render", help="Print the resolved graph and its launch plan (a dry run of `up`).")
def render_command(
    graph_file: GraphFile,
    overrides: Overrides = None,
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="yaml | json | shell | mermaid | k8s | dynamo-k8s | slurm")
    ] = "yaml",
) -> None:
    from dynamo_graph.graph.errors import GraphError
    from dynamo_graph.graph.targets.dispatch import ENGINES_OF_FORMAT, FORMATS, render

    if fmt not in FORMATS:
        raise _fail(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    built = _build_or_exit(graph_file, overrides, ENGINES_OF_FORMAT.get(fmt, "dyngraph"))
    try:
        text = render(built.graph, built.plan, fmt)
    except GraphError as e:
        raise _problems(graph_file, e) from None
    sys.stdout.write(text)


@app.command("import", help="Write the graph equivalent to a Dynamo DynamoGraphDeployment (DGD) file.")
def import_command(
    dgd_file: Annotated[Path, typer.Argument(help="a DynamoGraphDeployment YAML file")],
    output: Annotated[Path, typer.Option("--output", "-o", help="the graph file to write")],
) -> None:
    import shlex

    from dynamo_graph.graph.errors import GraphError
    from dynamo_graph.graph.paths import CHECKOUT_TINY_MODEL
    from dynamo_graph.graph.targets.k8s.dgd_import import DgdError, import_dgd_file, mocker_overrides

    try:
        imported = import_dgd_file(dgd_file, output)
    except DgdError as e:
        raise _fail(f"{dgd_file}: {e}") from None
    except GraphError as e:
        raise _problems(output, e) from None
    for note in imported.notes:
        err.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    err.print(f"{output}: graph {imported.name!r} from {dgd_file}", highlight=False)
    # Its engines want GPUs and packages a laptop lacks; the mocker on the tiny model needs neither.
    overrides = " ".join(shlex.quote(o) for o in mocker_overrides(imported.graph, str(CHECKOUT_TINY_MODEL)))
    build_it = "" if CHECKOUT_TINY_MODEL.is_dir() else " (after `make tiny-model` in dyngraph's checkout)"
    err.print(
        f"to run it on this machine without GPUs, on the mocker{build_it}:\n"
        f"  dyngraph up {shlex.quote(str(output))} {overrides}",
        highlight=False,
        markup=False,
    )


def _target_exit(command: Callable[[], int]) -> typer.Exit:
    """A target's command: its exit code, or 2 with the message when the target cannot do it."""
    from dynamo_graph.graph.targets.base import TargetError

    try:
        return typer.Exit(command())
    except TargetError as e:
        return _fail(str(e))


@app.command("up", help="Start a graph (or apply its changes to the running one); -d to detach.")
def up_command(
    graph_file: GraphFile,
    overrides: Overrides = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="run in the background")] = False,
    target: Annotated[
        str, typer.Option("--target", help="local (this machine and ssh hosts) | slurm (one Slurm job)")
    ] = "local",
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="preflight, then print what would change (as `diff`); start nothing"),
    ] = False,
) -> None:
    from dynamo_graph.graph.targets.dispatch import target_named

    def up() -> int:
        chosen = target_named(target)
        console = Console(soft_wrap=True)

        def built() -> Built:
            from dynamo_graph.graph.validate import gpu_warnings, tls_warnings

            result = _build_or_exit(graph_file, overrides)
            for warning in [*tls_warnings(result.graph), *gpu_warnings(result.graph)]:
                Console(stderr=True).print(f"[yellow]warning:[/] {warning}", highlight=False)
            return result

        with _graph_problems(graph_file):  # preflight on the graph's hosts, a Slurm job of it
            return chosen.up(
                graph_file,
                built,
                console,
                detach=detach,
                dry_run=dry_run,
            )

    raise _target_exit(up)


@app.command(
    "diff", help="What `up` would change in the running graph, per process (+ ~ -); exit 1 if anything."
)
def diff_command(graph_file: GraphFile, overrides: Overrides = None) -> None:
    from dynamo_graph.graph.targets.local.diff import print_diff

    built = _build_or_exit(graph_file, overrides)
    raise typer.Exit(print_diff(built, Console(soft_wrap=True)))


@app.command("ls", help="List the graphs running on this machine, with their state and frontends.")
def ls_command(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON, for scripts")] = False,
) -> None:
    from dynamo_graph.graph.targets.local.listing import ls

    raise typer.Exit(ls(Console(soft_wrap=True), as_json))


@app.command("status", help="Show a graph's processes (state, pid, restarts, uptime, revision, health).")
def status_command(
    graph_file: GraphFile,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON, for scripts and CI")] = False,
) -> None:
    from dynamo_graph.graph.targets.dispatch import target_of

    out = Console(soft_wrap=True)
    raise _target_exit(lambda: target_of(graph_file).status(graph_file, out, as_json=as_json))


@app.command("top", help="A live view of a running graph: per process and model, rates, latencies, KV use.")
def top_command(
    graph_file: GraphFile,
    once: Annotated[
        bool, typer.Option("--once", help="print one table (rates over --interval) and exit")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="with --once: print JSON, for scripts")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="seconds between refreshes")] = 1.0,
    sort: Annotated[
        str,
        typer.Option("--sort", help="column to sort by: name, requests_per_s, ttft_p90_ms, kv_usage, ..."),
    ] = "name",
    filter_: Annotated[str, typer.Option("--filter", help="show the processes matching this regex")] = "",
) -> None:
    from dynamo_graph.graph.targets.dispatch import target_of
    from dynamo_graph.graph.targets.local.state import StateDir
    from dynamo_graph.graph.targets.local.top import SORT_KEYS, descending_by_default
    from dynamo_graph.graph.targets.local.top_view import View, top

    if sort not in SORT_KEYS:
        raise typer.BadParameter(f"one of {', '.join(SORT_KEYS)}, not {sort!r}", param_hint="--sort")
    if as_json and not once:
        raise typer.BadParameter("--json prints one table: give --once too", param_hint="--json")
    target = target_of(graph_file)
    if target.name != "local":
        raise _fail(
            f"`dyngraph top` reads the supervisor of the local and ssh targets; this graph runs on "
            f"{target.name}: use `dyngraph status {graph_file}` (and the frontend's /metrics)"
        )
    view = View(sort=sort, descending=descending_by_default(sort), pattern=filter_)
    out = Console(soft_wrap=True)
    raise typer.Exit(
        top(StateDir.of(graph_file), out, once=once, as_json=as_json, interval_s=interval, view=view)
    )


@app.command("history", help="List the revisions `up` and `rollback` applied, with their git commits.")
def history_command(graph_file: GraphFile) -> None:
    from dynamo_graph.graph.targets.local.history import history
    from dynamo_graph.graph.targets.local.state import StateDir

    raise typer.Exit(history(StateDir.of(graph_file), Console(soft_wrap=True)))


@app.command("rollback", help="Apply a recorded revision again (default: the one before), rolling.")
def rollback_command(
    graph_file: GraphFile,
    revision: Annotated[int | None, typer.Argument(help="revision number (`dyngraph history`)")] = None,
) -> None:
    from dynamo_graph.graph.targets.dispatch import SLURM
    from dynamo_graph.graph.targets.local.commands import rollback
    from dynamo_graph.graph.targets.local.state import StateDir

    if SLURM.has_record(graph_file):  # the graph runs (ran) as a Slurm job: roll its steps
        raise _target_exit(lambda: SLURM.rollback(graph_file, Console(soft_wrap=True), revision))
    raise typer.Exit(rollback(StateDir.of(graph_file), Console(soft_wrap=True), revision))


@app.command("logs", help="Print a graph's process logs, prefixed and interleaved by time; -f follows.")
def logs_command(
    graph_file: GraphFile,
    process: Annotated[str | None, typer.Argument(help="a component or process name")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="lines of each log to show first")] = 100,
) -> None:
    from dynamo_graph.graph.targets.dispatch import target_of

    out = Console(soft_wrap=True)
    raise _target_exit(lambda: target_of(graph_file).logs(graph_file, out, process, follow, lines))


@app.command("down", help="Stop a graph: SIGTERM, grace period, SIGKILL; checks nothing is left.")
def down_command(graph_file: GraphFile) -> None:
    from dynamo_graph.graph.targets.dispatch import target_of

    raise _target_exit(lambda: target_of(graph_file).down(graph_file, Console(soft_wrap=True)))


@app.command("test", help="Smoke-test graphs: bring each up isolated, run its `tests`, tear it down.")
def test_command(
    graph_files: Annotated[list[Path], typer.Argument(help="graph YAML files", show_default=False)],
    junit: Annotated[Path | None, typer.Option("--junit", help="write a JUnit XML report here")] = None,
    override: Annotated[
        list[str] | None, typer.Option("--override", "-o", help="Hydra-style override for every graph")
    ] = None,
    keep_state: Annotated[
        bool, typer.Option("--keep-state", help="keep each run's state dir and logs (kept anyway on failure)")
    ] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="show the supervisor's events")] = False,
    against: Annotated[
        str | None,
        typer.Option(
            "--against", help="run the checks against this running frontend (http://host:port) instead"
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="with --against: only the checks that ask this model")
    ] = None,
) -> None:
    console = Console(soft_wrap=True)
    if against is not None:
        from dynamo_graph.smoke.against import run_against

        if len(graph_files) != 1:
            raise typer.BadParameter("--against takes one graph file", param_hint="graph_files")
        raise typer.Exit(run_against(graph_files[0], override or [], against, model, console))
    if model is not None:
        raise typer.BadParameter("--model goes with --against", param_hint="--model")
    from dynamo_graph.smoke.run import run_tests

    code = run_tests(
        graph_files, override or [], console, junit=junit, verbose=verbose, keep_state=keep_state
    )
    raise typer.Exit(code)


app.command("bench", help=BENCH_HELP)(bench_command)


@dev_app.command("tiny-model", help="Build the tiny real test model (tokenizer, safetensors, GGUF) into DIR.")
def tiny_model_command(
    out_dir: Annotated[Path, typer.Argument(help="folder to write")],
    allow_eos: Annotated[bool, typer.Option("--allow-eos", help="let greedy decoding emit eos")] = False,
    context_length: Annotated[int, typer.Option("--context-length")] = 512,
) -> None:
    from dynamo_graph.dev.tiny_model import build_tiny_model

    path = build_tiny_model(out_dir, allow_eos=allow_eos, context_length=context_length)
    err.print(f"tiny model written to {path}")


@dev_app.command(
    "tiny-lora", help="Build a LoRA adapter of the tiny model (PEFT folder + GGUF LoRA) into DIR."
)
def tiny_lora_command(
    out_dir: Annotated[Path, typer.Argument(help="folder to write")],
    base_model: Annotated[
        str, typer.Option("--base-model", help="recorded in adapter_config.json")
    ] = "tiny-model",
    seed: Annotated[int, typer.Option("--seed", help="another seed, another adapter")] = 1,
) -> None:
    from dynamo_graph.dev.tiny_lora import build_tiny_lora

    err.print(f"tiny LoRA adapter written to {build_tiny_lora(out_dir, base_model, seed=seed)}")


@keys_app.command(
    "add", help="Make a new API key for tenant NAME: print the key once, and its entry (or add it to --file)."
)
def keys_add_command(
    name: Annotated[str, typer.Argument(help="the tenant (metrics and logs name it)")],
    file: Annotated[
        Path | None, typer.Option("--file", help="append the entry to this keys file (a frontend reloads it)")
    ] = None,
    model: Annotated[
        list[str] | None, typer.Option("--model", help="a model the key may use (repeat; default all)")
    ] = None,
    cache_group: Annotated[
        str | None, typer.Option("--cache-group", help="share cached prefixes with this group's tenants")
    ] = None,
) -> None:
    from dynamo_graph.frontend.tenants import KeysFileError, add_entry, entry_yaml, new_key, parse_keys

    key = new_key()
    entry = entry_yaml(name, key, model, cache_group)
    try:
        if file is None:
            parse_keys("the entry", "keys:\n" + entry)  # the same checks a frontend makes
        else:
            add_entry(str(file), name, key, model, cache_group)
    except KeysFileError as error:
        raise _fail(str(error)) from None
    # The key goes to stdout only, once: nothing keeps it but whoever runs this.
    err.print(f"API key of {name} (shown once; only its sha256 is stored):")
    print(key)
    if file is None:
        err.print("its entry, for the `keys:` list of a keys file:")
        print(entry, end="")
    else:
        err.print(f"added to {file}")


@app.command("version", help="Print the version.")
def version_command() -> None:
    print(__version__)


def _run_fast(args: list[str]) -> None:
    """`dyngraph run` with a plain command line skips typer (cli/run.py says why)."""
    from dynamo_graph.cli.run import main_fast

    code = main_fast(args)
    if code is not None:
        sys.exit(code)


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        _run_fast(sys.argv[2:])
    app()


def dynamo_run_main() -> None:
    """`dynamo-run ...` is `dyngraph run ...`."""
    _run_fast(sys.argv[1:])
    app(args=["run", *sys.argv[1:]], prog_name="dynamo-run")
