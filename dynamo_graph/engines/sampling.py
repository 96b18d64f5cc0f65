"""The engine-neutral part of turning a request's sampling options into an engine library's.

Every engine adapter (vLLM, SGLang, TensorRT-LLM, llama.cpp, mistral.rs) spells sampling in its
library's words, but what the words mean is decided once, here: one choice per request, the
default output budget (the context left after the prompt), the token ids that end a sequence,
and which guided-decoding constraint a request asks for, with `guided_choice` turned into one
regex form for libraries that have no choice constraint of their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import PreprocessedRequest, SamplingOptions

GuidedKind = Literal["json", "regex", "grammar", "choice"]


def refuse_several_choices(request: PreprocessedRequest, engine: str) -> None:
    """n / best_of > 1: the adapters generate one sequence per request. The frontend refuses
    `n` already; this keeps direct callers (and best_of) from getting one answer silently."""
    so = request.sampling_options
    if (so.n or 1) > 1 or (so.best_of or 1) > 1:
        raise InvalidArgument(
            f"n > 1 / best_of > 1 is not supported by out={engine}: it generates one choice per "
            "request (n and best_of must be 1)",
            param="n",
        )


def context_room(request: PreprocessedRequest, context_length: int | None) -> int | None:
    """The tokens the context holds after the prompt (at least 1), or None when it is unknown."""
    if not context_length:
        return None
    return max(context_length - len(request.token_ids), 1)


def max_new_tokens(request: PreprocessedRequest, context_length: int | None) -> int | None:
    """The request's max_tokens, else the context left after the prompt (None: neither is known)."""
    asked = request.stop_conditions.max_tokens
    return context_room(request, context_length) if asked is None else asked


def capped_max_tokens(request: PreprocessedRequest, context_length: int) -> int:
    """For engines that enforce the context themselves: the request's max_tokens, never more than
    the context left after the prompt, and that room when max_tokens is unset."""
    room = max(context_length - len(request.token_ids), 1)
    asked = request.stop_conditions.max_tokens
    return room if asked is None else min(asked, room)


def stop_token_ids(request: PreprocessedRequest, *, with_eos: bool = True) -> set[int]:
    """The ids that end the sequence: the requested stop ids and, unless ignore_eos, the hidden
    ones (the chat template's end of turn) and the model's eos ids (`with_eos=False` for a library
    that applies the model's eos itself)."""
    sc = request.stop_conditions
    ids = set(sc.stop_token_ids or ())
    if not sc.ignore_eos:
        ids.update(sc.stop_token_ids_hidden or ())
        if with_eos:
            ids.update(request.eos_token_ids)
    return ids


@dataclass(frozen=True)
class Guided:
    """The one guided-decoding constraint of a request: a JSON schema (a dict or its JSON text), a
    regex, a grammar (EBNF/GBNF text) or a list of choices."""

    kind: GuidedKind
    value: Any


def choice_regex(choices: list[str]) -> str:
    """A regex that matches exactly one of `choices` (literal text)."""
    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


def guided(so: SamplingOptions, *, choice_as_regex: bool = True) -> Guided | None:
    """The request's constraint; one per request (the frontend takes one), looked up in this
    order. `choice_as_regex`: choices as `choice_regex`, for libraries without a choice kind."""
    if so.guided_json is not None:
        return Guided("json", so.guided_json)
    if so.guided_regex is not None:
        return Guided("regex", so.guided_regex)
    if so.guided_grammar is not None:
        return Guided("grammar", so.guided_grammar)
    if so.guided_choice:
        if choice_as_regex:
            return Guided("regex", choice_regex(list(so.guided_choice)))
        return Guided("choice", list(so.guided_choice))
    return None
