"""What the engines implementing the KV transfer contract share (backend/engine.py: `prefill`,
`generate_from_kv`; backend/kv_transfer.py: `KvHandoff`).

A prefill is the engine's own request cut to its first token: `first_token_request` cuts it and
`first_token_answer` folds the stream into the one chunk a prefill worker returns, saying whether
the request goes on (a request that ended at its first token hands nothing over).

Engines whose KV moves by their own connector (vLLM's `kv_transfer_config`: NIXL, Mooncake, shared
storage; SGLang's bootstrap server; TensorRT-LLM's cache transceiver) do not hand their KV cache
to us: they hand over the connector's transfer parameters, a few hundred bytes that our data path
carries from the prefill worker to the decode worker, whose engine then pulls the KV itself.
`connector_handoff` packs those parameters (JSON) with a digest of the prompt they belong to, under
a format naming the engine and the connector; `connector_params` unpacks them on the decode side
and refuses (`KvImportError`) another connector's or another prompt's: with a wrong prompt a
connector would load a KV cache that does not match the tokens, so the decode worker prefills
locally instead.

A decode request is the prompt followed by the token(s) the prefill worker already sent (the
frontend's continuation), but these engines' protocols want the prefill's prompt itself (vLLM's
NixlConnector kills its engine core on a request with more blocks than the prefill computed) and
generate its first token again: `prompt_request` cuts the request back to the prompt (with room
for those tokens) and `without_known` drops them from the stream, after checking that they are
the same (under sampling they may not be: the worker then prefills locally).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec

from dynamo_graph.backend.engine import KvImportError
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest

_replace = msgspec.structs.replace


def first_token_request(request: PreprocessedRequest) -> PreprocessedRequest:
    """`request` limited to its first token (min_tokens capped to match)."""
    sc = request.stop_conditions
    first_only = msgspec.structs.replace(
        sc, max_tokens=1, min_tokens=None if sc.min_tokens is None else min(sc.min_tokens, 1)
    )
    return msgspec.structs.replace(request, stop_conditions=first_only)


async def first_token_answer(
    stream: AsyncIterator[LLMEngineOutput], request: PreprocessedRequest
) -> tuple[LLMEngineOutput, bool]:
    """The chunks of a `first_token_request` stream as one, and whether `request` goes on after it
    (it does not when it ended there: eos, a stop id, its own max_tokens of 1, cancelled, failed;
    the chunk then keeps its finish reason and usage)."""
    answer = LLMEngineOutput()
    async for out in stream:
        answer.token_ids.extend(out.token_ids)
        if out.cached_tokens is not None:
            answer.cached_tokens = out.cached_tokens
        if out.finish_reason is not None:
            answer.finish_reason = out.finish_reason
            answer.completion_usage = out.completion_usage
            answer.error = out.error
    if answer.finish_reason != "length" or request.stop_conditions.max_tokens == 1:
        return answer, False
    answer.finish_reason = None
    answer.completion_usage = None
    return answer, True


def connector_format(engine: str, connector: str) -> str:
    """The handoff format of `engine`'s native `connector` ("vllm-connector/1:NixlConnector")."""
    return f"{engine}-connector/1:{connector}"


def prompt_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("q", tokens).tobytes()).hexdigest()


def connector_handoff(format: str, prompt: Sequence[int], params: Mapping[str, Any] | None) -> KvHandoff:
    """A handoff of the connector parameters `params` (JSON-serialisable; None when the connector
    needs none, e.g. a store keyed by the prompt) for the KV of `prompt`."""
    body = {"params": None if params is None else dict(params), "prompt_sha256": prompt_digest(prompt)}
    try:
        data = json.dumps(body, separators=(",", ":")).encode()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{format}: the connector's transfer parameters are not JSON: {err}") from None
    return KvHandoff(format, len(prompt), data)


def connector_params(handoff: KvHandoff, format: str, token_ids: Sequence[int]) -> dict[str, Any] | None:
    """The connector parameters of `handoff` for a request of `token_ids` (the prompt, possibly
    followed by tokens generated since); KvImportError unless it is this connector's handoff for
    this prompt."""
    if handoff.format != format:
        raise KvImportError(f"a {handoff.format!r} handoff cannot be loaded by {format!r}")
    if handoff.num_tokens > len(token_ids):
        raise KvImportError(
            f"the handoff covers {handoff.num_tokens} tokens, more than the request's {len(token_ids)}"
        )
    try:
        body = json.loads(handoff.data)
        params, digest = body["params"], body["prompt_sha256"]
    except (ValueError, TypeError, KeyError) as err:
        raise KvImportError(f"a malformed {format!r} handoff: {type(err).__name__}: {err}") from None
    if digest != prompt_digest(token_ids[: handoff.num_tokens]):
        raise KvImportError("the handoff's prompt is not this request's")
    if params is not None and not isinstance(params, dict):
        raise KvImportError(f"a malformed {format!r} handoff: its parameters are not an object")
    return params


def prompt_request(request: PreprocessedRequest, num_tokens: int) -> tuple[PreprocessedRequest, list[int]]:
    """`request` cut back to its first `num_tokens` tokens (the prefill's prompt), with its token
    limits raised by the tokens after them; and those tokens (which the client already has)."""
    known = list(request.token_ids[num_tokens:])
    sc = request.stop_conditions
    stop = _replace(
        sc,
        max_tokens=None if sc.max_tokens is None else sc.max_tokens + len(known),
        min_tokens=None if sc.min_tokens is None else sc.min_tokens + len(known),
    )
    return _replace(request, token_ids=request.token_ids[:num_tokens], stop_conditions=stop), known


async def without_known(
    stream: AsyncIterator[LLMEngineOutput], known: Sequence[int]
) -> AsyncIterator[LLMEngineOutput]:
    """The stream of a `prompt_request` without its first tokens, which must be `known`
    (KvImportError, before anything is yielded, when they are not); usage counted as the
    original request's."""
    pending, cached = list(known), None
    try:
        async for out in stream:
            if pending:
                head = out.token_ids[: len(pending)]
                if head != pending[: len(head)]:
                    raise KvImportError(
                        f"the decode engine generated {head}, not the prefill's {pending[: len(head)]}"
                    )
                pending, out.token_ids = pending[len(head) :], out.token_ids[len(head) :]
                if not out.token_ids and out.finish_reason is None:
                    cached = out.cached_tokens if cached is None else cached
                    continue
            if out.cached_tokens is None:
                out.cached_tokens, cached = cached, None
            usage = out.completion_usage
            if usage is not None and known:
                out.completion_usage = _replace(
                    usage,
                    prompt_tokens=usage.prompt_tokens + len(known),
                    completion_tokens=max(usage.completion_tokens - len(known), 0),
                )
            yield out
    finally:  # now, not when the generator is collected: the engine's request ends with it
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
