"""Settings declared once: a dataclass field, from which the command line, argv and checks derive.

A room declares its settings as a dataclass whose fields are `setting(...)`s: the type (with
`Literal` choices), the default, the bounds, the `dyngraph run` flag, Dynamo's spelling of the
same flag, and the field's docstring (an attribute docstring, as vLLM's config classes have).
Everything else is derived here: the fast command-line parser's table, the value conversion, the
range and choice checks, the argv a compiler writes (`to_argv`), and the docs (`field_docs`).
The graph schema builds its sections from the same fields (graph/sections.py), and the CLI its
typer options (cli/run_options.py).

A ground module: it imports nothing of the package, and nothing heavy (a worker parses its
command line with it before anything else is loaded).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

META_KEY = "dyngraph.setting"
# `--use-kv-events true`: dynamo-run's boolean flags that take a word.
BOOL_WORDS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


@dataclass(frozen=True, slots=True)
class Spec:
    """What a field's type and default do not say."""

    flag: str | None = None  # the `dyngraph run` flag; None: not on the command line
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    bool_word: bool = False  # a bool flag that takes a value (true/false) instead of standing alone
    dynamo: str | None = None  # Dynamo's flag for the same setting (render -f dynamo-k8s, import)
    in_graph: bool = True  # whether the graph's section of this class has the key


def setting(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    bool_word: bool = False,
    dynamo: str | None = None,
    in_graph: bool = True,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is a setting (see the module docstring)."""
    spec = Spec(flag=flag, ge=ge, gt=gt, le=le, bool_word=bool_word, dynamo=dynamo, in_graph=in_graph)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={META_KEY: spec})
    return dataclasses.field(default=default, metadata={META_KEY: spec})


@dataclass(frozen=True, slots=True)
class Option:
    """One setting as the derivations need it."""

    owner: type
    name: str  # the field (and the graph key)
    kind: type  # int, float, str, bool or Path
    optional: bool  # None is a value
    choices: tuple[str, ...] | None
    default: Any
    spec: Spec

    @property
    def flag(self) -> str | None:
        return self.spec.flag

    @property
    def param(self) -> str:
        """The command line's parameter name: the flag without dashes (`http_body_limit_mb`)."""
        return (self.spec.flag or self.name).lstrip("-").replace("-", "_")

    @property
    def annotation(self) -> Any:
        """The type the CLI parses the flag to (choices are checked afterwards, with one wording)."""
        kind = str if self.spec.bool_word else self.kind
        return kind | None if self.optional else kind

    @property
    def cli_default(self) -> Any:
        if self.spec.bool_word:
            return "true" if self.default else "false"
        return self.default


class SettingError(ValueError):
    """A setting that cannot be used; the message names settings as the caller spells them."""


Spell = Callable[[str], str]


def _kind_of(hint: Any) -> tuple[type, bool, tuple[str, ...] | None]:
    optional = False
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        optional = len(rest) < len(args)
        (hint,) = rest
    if typing.get_origin(hint) is Literal:
        return str, optional, tuple(typing.get_args(hint))
    if hint in (int, float, str, bool, Path):
        return hint, optional, None
    raise TypeError(f"a setting's type must be int, float, str, bool, Path or a Literal, not {hint!r}")


@functools.cache
def options(cls: type) -> tuple[Option, ...]:
    """The settings among `cls`'s dataclass fields, in declaration order."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(META_KEY)
        if spec is None:
            continue
        kind, optional, choices = _kind_of(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        found.append(Option(cls, f.name, kind, optional, choices, default, spec))
    return tuple(found)


def flagged(*classes: type) -> tuple[Option, ...]:
    """The options of `classes` that have a command-line flag."""
    return tuple(opt for cls in classes for opt in options(cls) if opt.flag)


# ---- checks ---------------------------------------------------------------------------------------


def flag_speller(cls: type) -> Spell:
    """Names settings of `cls` as their flags (`--http-body-limit-mb`)."""
    flags = {opt.name: opt.flag or opt.name for opt in options(cls)}
    return lambda name: flags.get(name, name)


def check_values(obj: Any, spell: Spell) -> None:
    """Choices and bounds of every setting of `obj`; a SettingError for the first one broken."""
    for opt in options(type(obj)):
        value = getattr(obj, opt.name)
        if value is None:
            if opt.optional:
                continue
            raise SettingError(f"{spell(opt.name)} needs a value")
        if opt.choices is not None and value not in opt.choices:
            raise SettingError(f"{spell(opt.name)} must be one of {', '.join(opt.choices)}, not {value!r}")
        if opt.kind in (int, float):
            _check_bounds(opt, value, spell)


def _check_bounds(opt: Option, value: float, spell: Spell) -> None:
    spec, name = opt.spec, spell(opt.name)
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(f"{name} must be a finite number, not {value:g}")
    if spec.ge is not None and not value >= spec.ge:
        raise SettingError(f"{name} must be at least {spec.ge:g}, not {value:g}")
    if spec.gt is not None and not value > spec.gt:
        raise SettingError(f"{name} must be above {spec.gt:g}, not {value:g}")
    if spec.le is not None and not value <= spec.le:
        raise SettingError(f"{name} must be at most {spec.le:g}, not {value:g}")


def given_names(obj: Any, explicit: Iterable[str]) -> set[str]:
    """The settings of `obj` that were given (`explicit`, field names) or differ from their default."""
    given = set(explicit)
    given.update(opt.name for opt in options(type(obj)) if getattr(obj, opt.name) != opt.default)
    return given


def validate(obj: Any, spell: Spell, given: Iterable[str] = ()) -> None:
    """Every check of `obj`: the fields' own, then the class's `check(given, spell)` for the
    rules that span fields (where a class has one)."""
    check_values(obj, spell)
    check = getattr(obj, "check", None)
    if check is not None:
        check(given_names(obj, given), spell)


# ---- the command line -----------------------------------------------------------------------------

_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def convert_fast(opt: Option, text: str) -> Any:
    """`text` as the typer command would give it, or None where typer's answer is not this simple
    (then the CLI hands the whole command line to typer, so errors read the same)."""
    kind = str if opt.spec.bool_word else opt.kind
    if kind is int:
        return int(text) if _INT.fullmatch(text) else None
    if kind is float:
        return float(text) if _FLOAT.fullmatch(text) else None
    if text.startswith("-"):
        return None
    return Path(text) if kind is Path else text


def from_params(cls: type, params: Mapping[str, Any], **extra: Any) -> Any:
    """An instance of `cls` from the command line's parameters (by `Option.param`); a word-bool
    flag's word becomes its bool here."""
    values = dict(extra)
    for opt in flagged(cls):
        if opt.param not in params:
            continue
        value = params[opt.param]
        if opt.spec.bool_word and isinstance(value, str):
            word = value.lower()
            if word not in BOOL_WORDS:
                raise SettingError(f"{opt.flag} takes true or false, not {value!r}")
            value = BOOL_WORDS[word]
        values[opt.name] = value
    return cls(**values)


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def to_argv(obj: Any) -> list[str]:
    """The flags that give `obj`'s settings, those that differ from their defaults (a plan stays
    as short as the graph that made it)."""
    argv: list[str] = []
    for opt in flagged(type(obj)):
        value = getattr(obj, opt.name)
        if value == opt.default or value is None:
            continue
        if opt.kind is bool and not opt.spec.bool_word:
            argv.append(opt.flag)  # type: ignore[arg-type]
        else:
            argv += [opt.flag, format_value(value)]  # type: ignore[list-item]
    return argv


# ---- docs -----------------------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of `cls` and its bases (a string right below a field), dedented
    and joined into one paragraph per field. (For help and docs only: a worker never reads them.)"""
    import ast
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        for node, after in zip(body.body, body.body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def help_text(opt: Option) -> str:
    """The field's docstring for `--help`, with its choices."""
    doc = field_docs(opt.owner).get(opt.name, "")
    if opt.choices and not any(c in doc for c in opt.choices):
        doc = f"{' | '.join(opt.choices)}. {doc}".strip()
    return doc


_VERBOSE = re.compile(r"-v+")


def parse_fast(
    args: list[str], table: tuple[Option, ...]
) -> tuple[list[str], dict[str, Any], set[str]] | None:
    """A command line of plain `--flag VALUE` options (those of `table`), words and `-v`s, as
    (words, parameters by `Option.param`, parameters given explicitly); None for anything this
    parser is not sure of (`--help`, an unknown or malformed option), which the CLI hands to
    typer so errors and help read the same. Arguments after `--` go to the engine, as
    `engine_argv` in the parameters."""
    by_flag = {opt.flag: opt for opt in table}
    words: list[str] = []
    params: dict[str, Any] = {opt.param: opt.cli_default for opt in table}
    params["verbose"] = 0
    explicit: set[str] = set()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":  # the rest is the engine's own (a python engine file's sys.argv)
            params["engine_argv"] = args[i:]
            break
        if not arg.startswith("-"):
            words.append(arg)
            explicit.add("words")
            continue
        if arg == "--verbose" or _VERBOSE.fullmatch(arg):
            params["verbose"] += 1 if arg == "--verbose" else len(arg) - 1
            explicit.add("verbose")
            continue
        flag, sep, value = arg.partition("=")
        opt = by_flag.get(flag)
        if opt is None:
            return None  # --help, an unknown option, ...
        if opt.kind is bool and not opt.spec.bool_word:
            if sep:
                return None
            params[opt.param] = True
            explicit.add(opt.param)
            continue
        if not sep:
            if i >= len(args):
                return None
            value = args[i]
            i += 1
        converted = convert_fast(opt, value)
        if converted is None:
            return None
        params[opt.param] = converted
        explicit.add(opt.param)
    return words, params, explicit


def given_fields(cls: type, explicit_params: set[str]) -> set[str]:
    """The fields of `cls` whose flags were given (`explicit_params` by `Option.param`)."""
    return {opt.name for opt in flagged(cls) if opt.param in explicit_params}
