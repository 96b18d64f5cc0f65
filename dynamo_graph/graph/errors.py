"""Errors in a graph file, reported all at once with where they are.

Every stage (loading, composition, schema validation, semantic checks) reports `Problem`s with
the key path (e.g. `components.backend.replicas`) and, when known, the file and line it came
from. `dyngraph validate` prints them all and exits 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Location:
    file: str  # a path, or "<override>" for a command-line override
    line: int | None = None  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line is not None else self.file


@dataclass(frozen=True, slots=True)
class Problem:
    path: str  # dotted key path, "" for the whole file
    message: str
    location: Location | None = None

    def __str__(self) -> str:
        where = f"{self.location}: " if self.location else ""
        key = f"{self.path}: " if self.path else ""
        return f"{where}{key}{self.message}"


class GraphError(Exception):
    """One or more problems; the CLI prints each on its own line and exits 2."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def did_you_mean(word: str, choices: Iterable[str], *, listing: bool = False) -> str:
    """ "; did you mean 'x'?" for the closest choice, else (with `listing`) every choice, else ""."""
    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; allowed: {', '.join(choices)}" if listing and choices else ""
