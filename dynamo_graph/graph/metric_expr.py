"""`/metrics` expressions of a graph's smoke checks: `NAME{label="v",...} OP NUMBER`.

A check like `dynamo_frontend_requests_total{model="tiny-model"} >= 3` is parsed when the graph
is validated (so a typo is a file:line error, not a failure at the end of a CI run) and
evaluated against a Prometheus text exposition with prometheus_client's own parser. The value
is the sum of every sample with that exact name whose labels match; label matchers are
PromQL's `=`, `!=`, `=~` and `!~` (regexes match the whole value).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

_OPS: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_EXPR = re.compile(
    r"^\s*(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{(?P<labels>[^}]*)\})?\s*"
    r"(?P<op>==|!=|>=|<=|>|<)\s*(?P<value>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)
_MATCHER = re.compile(
    r'\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*'
)


@dataclass(frozen=True)
class LabelMatcher:
    label: str
    op: str  # = != =~ !~
    value: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        actual = labels.get(self.label, "")
        if self.op in ("=", "!="):
            return (actual == self.value) == (self.op == "=")
        return (re.fullmatch(self.value, actual) is not None) == (self.op == "=~")


@dataclass(frozen=True)
class MetricExpr:
    name: str
    matchers: tuple[LabelMatcher, ...]
    op: str
    threshold: float
    text: str

    def value(self, exposition: str) -> float | None:
        """Sum of the matching samples in a Prometheus text exposition; None when none match."""
        from prometheus_client.parser import text_string_to_metric_families

        found = [
            sample.value
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples
            if sample.name == self.name and all(m.matches(sample.labels) for m in self.matchers)
        ]
        return sum(found) if found else None

    def holds(self, value: float) -> bool:
        return _OPS[self.op](value, self.threshold)

    def __str__(self) -> str:
        return self.text


def parse_metric_expr(text: str) -> MetricExpr:
    """Raises ValueError naming what is wrong with the expression."""
    match = _EXPR.match(text)
    if match is None:
        raise ValueError(
            f'{text!r} is not `NAME{{label="value",...}} OP NUMBER` (OP: {", ".join(_OPS)}), e.g. '
            '`dynamo_frontend_requests_total{model="tiny-model"} >= 3`'
        )
    matchers: list[LabelMatcher] = []
    labels = (match.group("labels") or "").strip().rstrip(",")
    if labels:
        for part in _split_matchers(labels):
            m = _MATCHER.fullmatch(part)
            if m is None:
                raise ValueError(f'label matcher {part.strip()!r} is not `label="value"` (= != =~ !~)')
            value = m.group("value").replace('\\"', '"').replace("\\\\", "\\")
            if m.group("op") in ("=~", "!~"):
                try:
                    re.compile(value)
                except re.error as e:
                    raise ValueError(f"label matcher {part.strip()!r}: bad regex: {e}") from None
            matchers.append(LabelMatcher(m.group("label"), m.group("op"), value))
    threshold = float(match.group("value"))
    return MetricExpr(match.group("name"), tuple(matchers), match.group("op"), threshold, text)


def _split_matchers(labels: str) -> list[str]:
    """Split `a="x,y",b="z"` at the commas outside quotes."""
    parts, current, quoted, escaped = [], [], False, False
    for char in labels:
        if char == "," and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
    parts.append("".join(current))
    return parts
