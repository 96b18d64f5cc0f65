"""Schemathesis hooks for the OpenAPI fuzz (tests/system/test_openapi_fuzz.py, `make fuzz-api`):
loaded by `schemathesis run` through SCHEMATHESIS_HOOKS=tests.support.schemathesis_hooks.

The deliberate deviations from the OpenAPI document, each by name with its reason: refusals that
depend on the model a request names, which the document (one for every model the frontend
serves, and for models that come and go) cannot state. Schemathesis's `positive_data_acceptance`
is swapped for `positive_data_acceptance_but_model_limits`: the same check, except that a 400
with one of these error codes passes. Every other check runs as shipped.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# error code -> (why the schema cannot say it, how Anthropic's code-less error messages show it)
DEVIATIONS = {
    "context_length_exceeded": (
        "how long a prompt (and max_tokens) may be is the model's context length",
        ("maximum context length",),
    ),
    "token_out_of_vocabulary": (
        "which token ids exist is the model's vocabulary (prompt ids, logit_bias keys, embedding input)",
        ("vocabulary",),
    ),
    "chat_template_error": (
        "the chat template is code the model ships; it may refuse turns (roles that must alternate, "
        "a tool call it cannot render), and its message says why",
        ("chat template error",),
    ),
    "unsupported_by_model": (
        "what the model's engine and parsers can do (logprobs, guided decoding, a tool-call parser, "
        "shortened embeddings, counting a prompt the engine templates itself) is its card's",
        (
            "is not supported by",
            "needs a tool call parser",
            "needs guided decoding",
            "applies its own template",
        ),
    ),
    # Fields that depend on each other, which a field's schema cannot relate:
    "min_tokens_above_max_tokens": (
        "min_tokens may not pass the completion bound: max_tokens, else the route's default (16 on "
        "/v1/completions) or what the model's context leaves",
        ("must be less than or equal to",),
    ),
    "tool_choice_without_tool": (
        "a tool_choice that forces a call names a function in tools (or needs tools at all)",
        ("tool_choice needs tools", "which is not in tools"),
    ),
    # vLLM's token-in/token-out request may leave `model` out where the server serves one model;
    # how many this frontend serves is the deployment's.
    "model_required": ("`model` may be left out only where the frontend serves one model", ()),
}


def _deviation(body: Any) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if code in DEVIATIONS:
        return code
    if body.get("type") != "error":  # an OpenAI body: its code said it all
        return None
    message = str(error.get("message", ""))
    return next((name for name, (_, shown) in DEVIATIONS.items() if any(s in message for s in shown)), None)


@schemathesis.check
def positive_data_acceptance_but_model_limits(ctx: Any, response: Any, case: Any) -> bool | None:
    """`positive_data_acceptance`, less the 400s named in DEVIATIONS."""
    if response.status_code == 400:
        try:
            body = json.loads(response.content)
        except ValueError:
            body = None
        if _deviation(body) is not None:
            return None
    return positive_data_acceptance(ctx, response, case)
