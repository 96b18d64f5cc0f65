"""Does an answer meet a check's `expect`? Every unmet expectation is one line saying what was
expected and what came, so a CI log (and the JUnit failure) explains itself."""

from __future__ import annotations

import re

from dynamo_graph.graph.schema import Expect, TokenCount
from dynamo_graph.smoke.client import Answer


def unmet(answer: Answer, expect: Expect) -> list[str]:
    """The expectations the answer does not meet (empty: it passes)."""
    failures = list(answer.problems)
    if answer.status != expect.status:
        text = f": {answer.text[:200]}" if answer.text else ""
        return [*failures, f"status {answer.status}, expected {expect.status}{text}"]
    failures += [
        f"text does not contain {s!r}: {_clip(answer.text)}" for s in expect.contains if s not in answer.text
    ]
    if expect.regex is not None and re.search(expect.regex, answer.text) is None:
        failures.append(f"text does not match /{expect.regex}/: {_clip(answer.text)}")
    if expect.finish_reason is not None and answer.finish_reason != expect.finish_reason:
        failures.append(f"finish_reason {answer.finish_reason!r}, expected {expect.finish_reason!r}")
    for key in ("prompt_tokens", "completion_tokens"):
        wanted = getattr(expect, key)
        if wanted is not None and (why := _count_unmet(getattr(answer, key), wanted)):
            failures.append(f"{key} {why}")
    if expect.tool_calls is not None and answer.tool_calls != expect.tool_calls:
        failures.append(f"tool calls {answer.tool_calls}, expected {expect.tool_calls}")
    if expect.ttft_s is not None and (answer.ttft_s is None or answer.ttft_s > expect.ttft_s):
        got = "no token" if answer.ttft_s is None else f"{answer.ttft_s:.3f} s"
        failures.append(f"time to first token {got}, budget {expect.ttft_s:g} s")
    if expect.latency_s is not None and answer.latency_s > expect.latency_s:
        failures.append(f"latency {answer.latency_s:.3f} s, budget {expect.latency_s:g} s")
    return failures


def _count_unmet(got: int | None, wanted: TokenCount) -> str:
    if got is None:
        return "missing from usage"
    if wanted.min is not None and wanted.min == wanted.max:
        return "" if got == wanted.min else f"{got}, expected {wanted.min}"
    if wanted.min is not None and got < wanted.min:
        return f"{got}, expected at least {wanted.min}"
    if wanted.max is not None and got > wanted.max:
        return f"{got}, expected at most {wanted.max}"
    return ""


def _clip(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")
