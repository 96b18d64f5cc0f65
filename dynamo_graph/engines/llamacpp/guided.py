"""What `out=llamacpp` adds to plain sampling: grammars (guided decoding) and log-probabilities.

Guided decoding becomes a GBNF grammar in llama.cpp's sampler chain, which masks every token
that cannot continue it (and, once it is complete, everything but end-of-generation):
`guided_json` (and so `response_format` json_object / json_schema) through llama-cpp-python's
own JSON-schema converter, `guided_choice` as an alternation of literals, `guided_grammar` as
GBNF itself. Regular expressions have no GBNF converter here, so `guided_regex` is refused. A
grammar is compiled once when the request arrives, so a bad one is a 400 before any decoding.
Once the grammar is complete it allows only end-of-generation tokens: the first one sampled ends
the request, unsent (the model's eos ids the request names are sent and hidden as usual).

Log-probabilities are those of the model's raw next-token distribution (log-softmax of its
logits, before penalties, temperature or the grammar), as vLLM and llama.cpp's own
`create_completion(logprobs=...)` report them.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import SamplingOptions, TopLogprob

CAPABILITIES = ["logprobs", "guided_json", "guided_choice", "guided_grammar"]
# llama-cpp-python's JSON-schema converter lets control characters into strings, which JSON
# forbids (llama.cpp's own converter leaves them out): its `char` rule is tightened to match.
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


def request_grammar(so: SamplingOptions) -> str | None:
    """The GBNF grammar a request's guided-decoding options ask for, or None."""
    if so.guided_regex is not None:
        raise InvalidArgument(
            "guided_regex is not supported by out=llamacpp (GBNF grammars only: use guided_grammar)",
            param="guided_regex",
        )
    if so.guided_json is not None:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        schema = so.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise InvalidArgument(f"guided_json is not valid JSON: {err}", param="guided_json") from None
        try:
            grammar = json_schema_to_gbnf(json.dumps(schema))
        except Exception as err:  # the converter raises whatever it meets first
            raise InvalidArgument(
                f"out=llamacpp cannot turn this JSON schema into a grammar: {err}", param="response_format"
            ) from None
        return grammar.replace(_LOOSE_CHAR, _STRICT_CHAR)
    if so.guided_choice is not None:
        if not so.guided_choice:
            raise InvalidArgument("guided_choice needs at least one choice", param="guided_choice")
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.guided_choice)
    return so.guided_grammar


def check_grammar(lc: Any, model: Any, grammar: str) -> None:
    """Compile `grammar` once against the model's vocabulary; InvalidArgument if it does not parse."""
    sampler = lc.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
    if not sampler:
        raise InvalidArgument(
            "the guided-decoding grammar does not parse (GBNF, root rule `root`)", param="guided_grammar"
        )
    lc.llama_sampler_free(sampler)


@functools.cache
def _eog_ids(lc: Any, vocab: int, n_vocab: int) -> frozenset[int]:
    return frozenset(t for t in range(n_vocab) if lc.llama_vocab_is_eog(vocab, t))


def eog_ids(lc: Any, model: Any) -> frozenset[int]:
    """The model's end-of-generation ids (what a complete grammar still allows)."""
    return _eog_ids(lc, model.vocab, model.n_vocab())


def add_grammar(lc: Any, chain: Any, model: Any, grammar: str) -> None:
    sampler = lc.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
    lc.llama_sampler_chain_add(chain.sampler, sampler)


def token_logprobs(
    lc: Any, ctx: Any, index: int, n_vocab: int, token: int, top: int
) -> tuple[float, list[TopLogprob]]:
    """log P(token) at the position of batch entry `index` of the last decode, and the `top`
    most likely tokens there."""
    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
    shifted = logits.astype(np.float64) - float(logits.max())
    log_z = float(np.log(np.exp(shifted).sum()))
    best: list[TopLogprob] = []
    if top > 0:
        k = min(top, n_vocab)
        ids = np.argpartition(-shifted, k - 1)[:k]
        ids = ids[np.argsort(-shifted[ids], kind="stable")]
        best = [TopLogprob(token_id=int(i), logprob=float(shifted[i]) - log_z) for i in ids]
    return float(shifted[token]) - log_z, best
