"""Read a graph file into a plain, fully resolved dict, and remember where every value came from.

This is the composition layer of `dyngraph up graph.yaml [overrides]` (docs/graphs.md):
YAML, Hydra defaults lists, templates, `${...}` interpolation, environment variables and
command-line overrides in Hydra's grammar. It knows nothing about the graph's schema: the dict it
returns is validated by `schema.py` / `validate.py`, which use the `SourceMap` to point their
problems at a file and line.

Templates. A graph pulls templates in with a Hydra defaults list; a template is named by its
path on the search path, without `.yaml`, with a leading slash (absolute, so it means the same
inside a template)::

    defaults:
      - /agg        # graphs/templates/agg.yaml
      - _self_      # this file's own keys merge after the template's, so the file wins

The search path is, in order: each directory in `DYNGRAPH_TEMPLATES` (`os.pathsep`-separated),
the checkout's `graphs/templates/`, then the graph file's own directory (for building blocks kept
next to graphs; it comes last so that `graphs/ci/agg.yaml` can use `/agg` without meaning
itself). Without `_self_` the file's keys still merge last (Hydra >= 1.1). A template may have a
defaults list of its own, and `/name@some.key` places one under `some.key` (Hydra's packages).

Overrides are Hydra's: `a.b=1` changes an existing key, `+a.b=1` adds one, `++a.b=1` adds or
changes, `~a.b` deletes. A key the graph schema knows (`known_key`) needs no `+`: `a.b=1` sets it
whether or not the file has it. `hydra.*` keys are not part of a graph and are refused. With
`keys_at` (the schema's keys under a path), `a.b=1` and `~a.b` of a key the graph does not have
get a did-you-mean as the file's own unknown keys do: a misspelled key, or the misspelled name
of a component, model or host (one close to a name the graph has; `+` adds it as new).

Environment. `${env:VAR}` / `${env:VAR,default}` and Hydra's `${oc.env:...}` read the `env`
mapping given to `load_graph` (default `os.environ`); values are strings, as the process would
see them (`schema.py` coerces numbers). An unset variable without a default is a problem that
names the variable and the key that used it. `${env_path:VAR,default}` is `env` for a path: a
relative path in the variable means the directory the command was typed in (made absolute here),
while the default, written in the file, stays relative to the file; a hub id stays as it is.

Relative paths are left as written: the compiler resolves them against `LoadedGraph.graph_dir`.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.default_element import ResultDefault
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dynamo_graph.graph.errors import GraphError, Location, Problem, did_you_mean
from dynamo_graph.graph.paths import state_dir as state_dir  # re-exported

KeysAt = Callable[[str], "list[str] | None"]
"""The schema's keys under a dotted path; None where the keys are the graph's own names or free."""

OVERRIDE = Location("<override>")
"""Where a value set on the command line comes from."""

SHIPPED_TEMPLATES = Path(__file__).resolve().parents[2] / "graphs" / "templates"
"""The checkout's templates; absent from a wheel install, where only DYNGRAPH_TEMPLATES applies."""


@dataclass(frozen=True)
class SourceMap:
    """Where each value of a loaded graph was set: dotted key path (list items by index,
    `hosts.0`) -> the file and line of the key that set it last, or `<override>`."""

    entries: dict[str, Location] = field(default_factory=dict)
    root: Location | None = None  # the graph file itself, for keys no file sets (e.g. missing ones)

    def locate(self, path: str) -> Location | None:
        """The location of `path`, else of its nearest ancestor that has one, else the file."""
        while path:
            if path in self.entries:
                return self.entries[path]
            path = path.rpartition(".")[0]
        return self.root


@dataclass(frozen=True)
class LoadedGraph:
    data: dict[str, Any]  # plain containers, interpolations resolved
    source: SourceMap
    file: Path  # absolute
    graph_dir: Path  # relative paths in `data` are relative to this


def load_graph(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    known_key: Callable[[str], bool] | None = None,
    keys_at: KeysAt | None = None,
) -> LoadedGraph:
    """Compose, override and resolve a graph file. Raises GraphError with every problem found at
    the stage that failed (YAML, overrides, composition, interpolation). `known_key(path)` says
    whether the schema has a key: `key=value` of such a key sets it even where the file leaves it
    out (Hydra would want `+key=value` then). `keys_at` checks the overrides' keys (see above)."""
    file = Path(os.path.abspath(path))
    environ = os.environ if env is None else env
    root = _parse_yaml(file)
    if not isinstance(root, yaml.MappingNode):
        kind = "empty" if root is None else f"a {root.id}"
        where = Location(str(file), None if root is None else root.start_mark.line + 1)
        message = f"a graph file is a mapping of keys (name, components, ...); this one is {kind}"
        raise GraphError([Problem("", message, where)])
    if problems := _check_keys(file, root) + _check_overrides(overrides):
        raise GraphError(problems)

    given = list(overrides)
    if known_key is not None:
        overrides = [_add_known(text, known_key) for text in overrides]
    search_dirs = [*_template_dirs(environ), file.parent]
    defaults_at = next((_loc(file, k) for k, _ in root.value if k.value == "defaults"), Location(str(file)))
    try:
        cfg, defaults, config_overrides = _compose(file, search_dirs, list(overrides), defaults_at)
    except GraphError as failed:
        if keys_at is not None and any(p.location == OVERRIDE for p in failed.problems):
            # Hydra refused an override: say which key, from the keys the files have.
            _, defaults, _ = _compose(file, search_dirs, [], defaults_at)
            keys = set(_source_map(file, root, search_dirs, defaults, []).entries)
            if problems := _override_key_problems(given, keys, keys_at):
                raise GraphError(problems) from failed
        raise
    if keys_at is not None:
        keys = set(_source_map(file, root, search_dirs, defaults, []).entries)
        if problems := _override_key_problems(given, keys, keys_at):
            raise GraphError(problems)
    source = _source_map(file, root, search_dirs, defaults, config_overrides)
    data = _resolve(cfg, source, environ)
    return LoadedGraph(data=data, source=_prune(source, data), file=file, graph_dir=file.parent)


# ---- environment resolvers --------------------------------------------------------------------

_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("dyngraph_environ", default=None)
_NO_DEFAULT = object()


class _UnsetEnvVar(KeyError):
    """An environment variable used without a default is not set."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Environment variable '{name}' not found")
        self.name = name


def _env(name: str, default: Any = _NO_DEFAULT) -> str | None:
    # oc.env's semantics (string values, str(default), None stays None), but reading the
    # environment load_graph was given, so callers and tests need not touch os.environ.
    environ = _ENVIRON.get()
    environ = os.environ if environ is None else environ
    if name in environ:
        return environ[name]
    if default is _NO_DEFAULT:
        raise _UnsetEnvVar(name)
    return None if default is None else str(default)


def _env_path(name: str, default: Any = _NO_DEFAULT) -> str | None:
    # A relative path a user exports names something under their current directory, not under
    # the template's folder; what looks like a hub id (no such path here, no leading dot) stays.
    value = _env(name, default)
    environ = _ENVIRON.get()
    given = name in (os.environ if environ is None else environ)
    if given and value and not os.path.isabs(value) and (value.startswith(".") or os.path.exists(value)):
        return os.path.abspath(value)
    return value


# Replacing oc.env is safe outside load_graph: with no environment set it reads os.environ, as
# OmegaConf's own does. replace=True makes re-import (and a second registration) harmless.
OmegaConf.register_new_resolver("env", _env, replace=True)
OmegaConf.register_new_resolver("oc.env", _env, replace=True)
OmegaConf.register_new_resolver("env_path", _env_path, replace=True)


# ---- YAML -------------------------------------------------------------------------------------


def _parse_yaml(file: Path) -> yaml.Node | None:
    """The YAML node tree (which has line numbers, unlike loaded data)."""
    try:
        with file.open(encoding="utf-8") as stream:  # a stream, so that marks carry the file name
            return yaml.compose(stream, Loader=yaml.SafeLoader)
    except OSError as exc:
        raise GraphError([Problem("", f"cannot read the file: {exc.strerror}", Location(str(file)))]) from exc
    except yaml.MarkedYAMLError as exc:
        raise GraphError([_yaml_problem(exc)]) from exc


def _yaml_problem(exc: yaml.MarkedYAMLError) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    where = Location(mark.name, mark.line + 1) if mark is not None else None
    message = " ".join(p for p in (exc.context, exc.problem) if p)
    return Problem("", f"invalid YAML: {message}", where)


# ---- checks before composing ------------------------------------------------------------------

_PARSER = OverridesParser.create()


def _check_overrides(overrides: Sequence[str]) -> list[Problem]:
    """Every malformed override at once (Hydra would stop at the first)."""
    problems = []
    for text in overrides:
        try:
            key = _PARSER.parse_override(text).key_or_group
        except HydraException as exc:  # parse_override raises the base class
            key = re.sub(r"^[~+]*", "", text).partition("=")[0]
            problems.append(Problem(key, f"cannot parse override {text!r}: {_first_line(exc)}", OVERRIDE))
            continue
        if key.split(".")[0] == "hydra":
            problems.append(
                Problem(
                    key,
                    f"override {text!r}: hydra.* keys are not part of a graph "
                    "(add template directories with DYNGRAPH_TEMPLATES)",
                    OVERRIDE,
                )
            )
    return problems


def _add_known(text: str, known_key: Callable[[str], bool]) -> str:
    """`key=value` as `++key=value` (add or change) when the schema knows `key`; anything else as
    written. Called on overrides that parsed."""
    override = _PARSER.parse_override(text)
    plain = override.type == OverrideType.CHANGE and override.package is None
    return f"++{text}" if plain and known_key(override.key_or_group) else text


def _override_key_problems(overrides: Sequence[str], keys: set[str], keys_at: KeysAt) -> list[Problem]:
    """`a.b=1` and `~a.b` whose key the graph's files (`keys`) do not have and cannot mean: a key
    the schema has not there (Hydra would advise `+`), or a new name close to one the graph gives
    its own things (a component, model or host; Hydra would add it). A new key the schema has is
    fine, and so is a new name unlike any (`hosts.local`, which every graph has)."""
    problems = []
    for text in overrides:
        override = _PARSER.parse_override(text)
        if override.type not in (OverrideType.CHANGE, OverrideType.DEL) or override.package is not None:
            continue
        parts = override.key_or_group.split(".")
        for i, name in enumerate(parts):
            path, parent = ".".join(parts[: i + 1]), ".".join(parts[:i])
            if path in keys:
                continue
            allowed = keys_at(parent)
            if allowed is not None and name not in allowed:
                message = f"unknown key {name!r}" + did_you_mean(name, allowed, listing=True)
                problems.append(Problem(path, message, OVERRIDE))
            elif allowed is None and keys_at(path):  # a name the graph gives its own things
                names = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
                if suggestion := did_you_mean(name, names):  # a new name unlike any is meant new
                    adds = f" (`+{text}` adds it)" if override.type == OverrideType.CHANGE else ""
                    problems.append(Problem(path, f"{parent} has no {name!r}{suggestion}{adds}", OVERRIDE))
            break
    return problems


def _check_keys(file: Path, root: yaml.MappingNode) -> list[Problem]:
    """Duplicate keys (YAML would keep the last silently, OmegaConf stops at the first) and a
    top-level `hydra`, which Hydra would take as its own config and drop."""
    problems = []
    problems.extend(
        Problem("hydra", "`hydra` is reserved by Hydra and cannot be a graph key", _loc(file, key))
        for key, _ in root.value
        if key.value == "hydra"
    )

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, _join(path, str(i)))
        elif isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key, value in node.value:
                key_path = _join(path, str(key.value))
                if key.value in seen:
                    problems.append(Problem(key_path, "duplicate key", _loc(file, key)))
                seen.add(key.value)
                walk(value, key_path)

    walk(root, "")
    return problems


def _template_dirs(environ: Mapping[str, str]) -> list[Path]:
    extra = [Path(os.path.abspath(d)) for d in environ.get("DYNGRAPH_TEMPLATES", "").split(os.pathsep) if d]
    return [d for d in [*extra, SHIPPED_TEMPLATES] if d.is_dir()]


# ---- Hydra composition --------------------------------------------------------------------------

_HYDRA_LOCK = threading.Lock()  # GlobalHydra and the ConfigStore are one per process
_PRIMARY = "__dyngraph_graph__"


def _compose(
    file: Path, search_dirs: list[Path], overrides: list[str], defaults_at: Location
) -> tuple[DictConfig, list[ResultDefault], list[Override]]:
    """Hydra's composition of the graph, its defaults list in merge order, and the overrides that
    changed config values (rather than picking config group options)."""
    searchpath = ",".join(_quote(f"file://{d}") for d in search_dirs[1:])
    hydra_overrides = [*overrides, f"hydra.searchpath=[{searchpath}]"]
    with _HYDRA_LOCK:
        # The graph goes in through the ConfigStore, which Hydra searches last, so that its own
        # directory (which holds the file) can be on the search path without `defaults: [/agg]`
        # in a graph named agg.yaml meaning itself; and so that any suffix (.yml) works.
        # Left initialized by someone else, GlobalHydra would refuse initialize_config_dir.
        GlobalHydra.instance().clear()
        try:
            ConfigStore.instance().store(name=_PRIMARY, node=OmegaConf.load(file))
            with initialize_config_dir(version_base=None, config_dir=str(search_dirs[0])):
                cfg = compose(config_name=_PRIMARY, overrides=hydra_overrides)
                loader = GlobalHydra.instance().config_loader()
                defaults_list = loader.compute_defaults_list(_PRIMARY, hydra_overrides, RunMode.RUN)
        except yaml.MarkedYAMLError as exc:  # e.g. a template's syntax, or a tag OmegaConf refuses
            raise GraphError([_yaml_problem(exc)]) from exc
        except MissingConfigException as exc:
            where = ", ".join(str(d) for d in search_dirs)
            message = f"{_first_line(exc, file)} (templates are looked up in {where})"
            raise GraphError([Problem("defaults", message, defaults_at)]) from exc
        except RecursionError as exc:
            message = "the defaults list includes this graph itself (directly or through a template)"
            raise GraphError([Problem("defaults", message, defaults_at)]) from exc
        except (HydraException, OmegaConfBaseException) as exc:
            raise GraphError([_composition_problem(exc, file, overrides)]) from exc
    defaults = [d for d in defaults_list.defaults if not (d.config_path or "hydra/").startswith("hydra/")]
    return cfg, defaults, defaults_list.config_overrides


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _composition_problem(exc: Exception, file: Path, overrides: list[str]) -> Problem:
    message = " ".join(_first_line(e, file) for e in (exc, exc.__cause__) if e is not None and str(e))
    for text in overrides:
        key = _PARSER.parse_override(text).key_or_group
        if text in message or f"'{key}'" in message:
            return Problem(key, f"cannot apply override {text!r}: {' '.join(str(exc).split())}", OVERRIDE)
    full_key = getattr(exc.__cause__, "full_key", None) or ""
    return Problem(_dotted(full_key), f"cannot compose the graph: {message}", Location(str(file)))


# ---- source map -------------------------------------------------------------------------------


def _source_map(
    file: Path,
    root: yaml.MappingNode,
    search_dirs: list[Path],
    defaults: list[ResultDefault],
    config_overrides: list[Override],
) -> SourceMap:
    """Replay the composition on YAML node trees: each config of the defaults list in merge order
    (mappings merge, anything else replaces), then the overrides."""
    entries: dict[str, Location] = {}
    for default in defaults:
        found = (file, root) if default.primary else _find_config(default.config_path, search_dirs)
        if found is None:
            continue  # from Hydra's ConfigStore, not a file: no lines to report
        config_file, node = found
        if isinstance(node, yaml.MappingNode):
            prefix = default.package or ""
            for key, value in node.value:
                if key.value != "defaults":  # Hydra strips each config's top-level defaults list
                    _set_node(entries, _join(prefix, key.value), value, config_file, key.start_mark.line + 1)
    for override in config_overrides:
        path, value = override.key_or_group, override.value()
        if override.is_delete():
            _drop(entries, path, keep_self=False)
            continue
        if not isinstance(value, dict):  # Hydra merges a dict value into the key; others replace
            _drop(entries, path, keep_self=True)
        _set_value(entries, path, value)
    return SourceMap(entries, Location(str(file)))


def _find_config(config_path: str | None, search_dirs: list[Path]) -> tuple[Path, yaml.Node | None] | None:
    """The file Hydra loaded for `config_path`: the first on the search path, as Hydra looks."""
    for d in search_dirs:
        candidate = d / f"{config_path}.yaml"
        if candidate.is_file():
            return candidate, _parse_yaml(candidate)
    return None


def _set_node(entries: dict[str, Location], path: str, node: yaml.Node, file: Path, line: int) -> None:
    if not isinstance(node, yaml.MappingNode):
        _drop(entries, path, keep_self=True)
    entries[path] = Location(str(file), line)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _set_node(entries, _join(path, key.value), value, file, key.start_mark.line + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _set_node(entries, _join(path, str(i)), item, file, item.start_mark.line + 1)


def _set_value(entries: dict[str, Location], path: str, value: Any) -> None:
    entries[path] = OVERRIDE
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        _set_value(entries, _join(path, str(key)), child)


def _drop(entries: dict[str, Location], path: str, *, keep_self: bool) -> None:
    prefix = path + "."
    for key in [k for k in entries if k.startswith(prefix) or (k == path and not keep_self)]:
        del entries[key]


def _prune(source: SourceMap, data: dict[str, Any]) -> SourceMap:
    """Only the paths the result has, in the result's order."""
    return SourceMap({p: source.entries[p] for p in _paths(data, "") if p in source.entries}, source.root)


def _paths(value: Any, path: str) -> Iterator[str]:
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        child_path = _join(path, str(key))
        yield child_path
        yield from _paths(child, child_path)


# ---- interpolation ----------------------------------------------------------------------------


def _resolve(cfg: DictConfig, source: SourceMap, environ: Mapping[str, str]) -> dict[str, Any]:
    """Resolve every `${...}`; each one that fails, and each `???` left, is a problem at the key
    that holds it."""
    token = _ENVIRON.set(environ)
    try:
        problems: list[Problem] = []
        _check_node(cfg, "", source, problems)
        if problems:
            raise GraphError(problems)
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    finally:
        _ENVIRON.reset(token)
    assert isinstance(data, dict)
    return data


def _check_node(node: DictConfig | ListConfig, path: str, source: SourceMap, problems: list[Problem]) -> None:
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        child_path = _join(path, str(key))
        if OmegaConf.is_missing(node, key):
            problems.append(
                Problem(
                    child_path,
                    "required value (???) is not set: set it in the graph file or override it (key=value)",
                    source.locate(child_path),
                )
            )
        elif OmegaConf.is_interpolation(node, key):
            try:
                value = node[key]
                if isinstance(value, DictConfig | ListConfig):
                    OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
            except OmegaConfBaseException as exc:
                problems.append(Problem(child_path, _interpolation_message(exc), source.locate(child_path)))
        else:
            child = node[key]
            if isinstance(child, DictConfig | ListConfig):
                _check_node(child, child_path, source, problems)


def _interpolation_message(exc: BaseException) -> str:
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, _UnsetEnvVar):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, _UnsetEnvVar):
        fix = f"set it, or give a default: ${{env:{cause.name},default}}"
        return f"environment variable {cause.name} is not set and has no default ({fix})"
    return f"cannot resolve interpolation: {_first_line(exc)}"


# ---- small helpers ----------------------------------------------------------------------------


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _dotted(full_key: str) -> str:
    """OmegaConf's `hosts[0].ssh` as our `hosts.0.ssh`."""
    return re.sub(r"\[(\d+)\]", r".\1", full_key)


def _first_line(exc: BaseException, file: Path | None = None) -> str:
    text = str(exc).strip()
    if file is not None:  # Hydra knows the graph by its ConfigStore name
        text = text.replace(f"'{_PRIMARY}'", f"'{file.name}'")
    return text.splitlines()[0] if text else type(exc).__name__


def _loc(file: Path, node: yaml.Node) -> Location:
    return Location(str(file), node.start_mark.line + 1)
