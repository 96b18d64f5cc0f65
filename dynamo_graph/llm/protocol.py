"""Wire types between the frontend's pre/post-processing and an engine (docs/contracts.md).

msgspec Structs: cheap to build on the hot path and msgpack-ready for the request plane.
Field names follow Dynamo's PreprocessedRequest / LLMEngineOutput so real engines' adapters map
one to one.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length", "eos", "cancelled", "error"]


class StopConditions(msgspec.Struct, omit_defaults=True):
    """When generation ends. The postprocessor enforces all of these; engines should honour
    max_tokens, stop token ids and ignore_eos themselves to avoid wasted work."""

    max_tokens: int | None = None
    stop: list[str] | None = None
    # Token ids that end generation and are not shown (the model's eos ids), unless ignore_eos.
    stop_token_ids_hidden: list[int] | None = None
    # Token ids the request asked to stop on (OpenAI-ext `stop_token_ids`); also not shown.
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False


class SamplingOptions(msgspec.Struct, omit_defaults=True):
    n: int | None = None
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class OutputOptions(msgspec.Struct, omit_defaults=True):
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Dynamo shows special tokens by default (echo_core then returns the whole template).
    skip_special_tokens: bool = False


class KvTransferParams(msgspec.Struct, omit_defaults=True):
    """Where a prompt's KV cache waits after a remote prefill, and how to fetch it: the prefill
    worker's KV endpoint (`namespace.component.kv_fetch`, instance `instance_id`) holds it under
    `transfer_id` until one decode worker fetches it or it expires (backend/kv_transfer.py)."""

    namespace: str
    component: str
    instance_id: int
    transfer_id: str
    # Prompt tokens the KV covers, the engine's format tag, and the bytes it stands for.
    num_tokens: int
    format: str
    nbytes: int = 0


class BootstrapInfo(msgspec.Struct):
    """Where an engine that pairs the two halves of a request itself (SGLang) meets them: the
    prefill worker's bootstrap server and a room that names this request; the frontend sends
    the prompt to the prefill and the decode worker at once, both with it (router/disagg.py)."""

    host: str
    port: int
    room: int


class KvImportReport(msgspec.Struct, omit_defaults=True):
    """What a decode worker did with a request's KV transfer, on its first chunk: the bytes and
    seconds of a fetch that worked, or why it prefilled locally instead (`error`)."""

    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class RoutingHints(msgspec.Struct, omit_defaults=True):
    """What the KV router reads besides the prompt: the session whose turns should stay on one
    worker (`x-session-id`, `nvext.agent_context.session_id`) and the priority its queue orders
    by (`x-dynamo-request-priority`, `nvext.agent_hints.priority`; higher is more urgent)."""

    session_id: str | None = None
    priority: int | None = None
    # Leading prefixes of the prompt made of cached segments: (token count, a 16-byte key of
    # those ids), shortest first; the router reuses their block hashes (llm/segment_tokenizer.py).
    prefixes: list[tuple[int, bytes]] | None = None


class PreprocessedRequest(msgspec.Struct, omit_defaults=True):
    """A tokenized request as an engine of a Tokens-input model receives it."""

    model: str
    token_ids: list[int]
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    annotations: list[str] = msgspec.field(default_factory=list)
    # The data-parallel rank the router chose (engines with several ranks); None: engine's choice.
    dp_rank: int | None = None
    # Free-form extras passed through to the engine (e.g. nvext fields it understands).
    extra: dict[str, Any] | None = None
    # Disaggregated serving: the prompt's KV was computed by a prefill worker; fetch it there.
    kv_transfer_params: KvTransferParams | None = None
    # Or the KV moves between engines that pair up by a bootstrap room: both halves carry it.
    bootstrap_info: BootstrapInfo | None = None
    # Session and priority for the frontend's router; engines schedule by the priority too.
    routing: RoutingHints | None = None
    # Seeds the hash of the prompt's first KV block (vLLM's `cache_salt`): prefixes are shared
    # only between requests of one salt. The frontend sets it per tenant (docs/security.md).
    cache_salt: str | None = None


def request_priority(request: PreprocessedRequest) -> int:
    """The request's priority, Dynamo's sign (higher is more urgent); 0 when it has none."""
    hints = request.routing
    return 0 if hints is None or hints.priority is None else hints.priority


class CompletionUsage(msgspec.Struct, omit_defaults=True):
    """Token counts an engine reports on its final chunk (text-input engines need this)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


class TopLogprob(msgspec.Struct, omit_defaults=True):
    """One of the most likely tokens at a position (Dynamo's TopLogprob, without the text: the
    frontend has the tokenizer)."""

    token_id: int
    logprob: float


class LLMEngineOutput(msgspec.Struct, omit_defaults=True):
    """One chunk of an engine's stream: new token ids, and on the last chunk a finish reason."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    # Engines that produce text themselves may send it; the postprocessor re-derives it from ids.
    text: str | None = None
    finish_reason: FinishReason | None = None
    index: int | None = None
    # Per token of `token_ids` when the request asked (output_options.logprobs is not None): the
    # sampled token's log-probability, and the `output_options.logprobs` most likely tokens.
    log_probs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    cum_log_probs: float | None = None
    # Prompt tokens served from the engine's prefix cache (usage.prompt_tokens_details).
    cached_tokens: int | None = None
    completion_usage: CompletionUsage | None = None
    error: str | None = None
    # A prefill worker's answer: the prompt's KV waits there for the decode worker.
    kv_transfer_params: KvTransferParams | None = None
    # A decode worker's first chunk of a request that came with kv_transfer_params.
    kv_import: KvImportReport | None = None


class PreprocessedEmbeddingRequest(msgspec.Struct, omit_defaults=True):
    """An embeddings request as an embedding worker receives it: one token-id list per input
    (Dynamo's PreprocessedEmbeddingRequest). `dimensions`: truncate each vector to this many
    (Matryoshka models only; the frontend checks the card's `embedding_dimensions` capability)."""

    model: str
    token_ids: list[list[int]]
    dimensions: int | None = None
    annotations: list[str] = msgspec.field(default_factory=list)


class EmbeddingOutput(msgspec.Struct, omit_defaults=True):
    """An embedding worker's answer, one frame: a unit-length vector per input, in input order."""

    embeddings: list[list[float]] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None
