"""`register_llm`: publish a worker's model deployment card so frontends can serve it.

As in Dynamo: `ModelType.Backend` workers take token ids (frontends pre/post-process with the
card's tokenizer and template); `ModelType.Chat` / `ModelType.Completion` workers take OpenAI
requests and return OpenAI responses. The card lives under the worker's lease at
`v1/mdc/{ns}/{comp}/{ep}/{instance_id:x}`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.model_source import resolve_model

if TYPE_CHECKING:
    from dynamo_graph.runtime.runtime import Endpoint


class ModelType(enum.Flag):
    Backend = enum.auto()
    Chat = enum.auto()
    Completion = enum.auto()
    Completions = Completion  # the newer spelling


class ModelInput(enum.Enum):
    Tokens = "tokens"
    Text = "text"


def card_model_type(model_type: ModelType) -> tuple[str, list[str]]:
    """(model_input, endpoint kinds) of the card for a ModelType."""
    if ModelType.Backend in model_type:
        return "tokens", ["chat", "completions"]
    kinds = [
        kind
        for flag, kind in ((ModelType.Chat, "chat"), (ModelType.Completion, "completions"))
        if flag in model_type
    ]
    if not kinds:
        raise ValueError(f"model_type {model_type} names no endpoint kind")
    return "text", kinds


async def publish_card(endpoint: Endpoint, card: ModelDeploymentCard) -> None:
    discovery = endpoint.runtime.discovery
    if discovery is None:
        return  # static mode: the frontend is told about the model on its command line
    await discovery.put(endpoint.name.card_key(endpoint.instance_id), card.to_json())


async def register_llm(
    *args: Any,
    model_name: str | None = None,
    context_length: int | None = None,
    kv_cache_block_size: int = 16,
    migration_limit: int = 0,
    user_data: dict[str, Any] | None = None,
) -> ModelDeploymentCard:
    """`register_llm(ModelType.Backend, endpoint, model_path[, model_name], ...)`, or Dynamo's
    newer `register_llm(ModelInput.Tokens, ModelType.Chat, endpoint, model_path[, model_name])`."""
    if args and isinstance(args[0], ModelInput):
        model_input, model_type, endpoint, model_path, *extra = args
        input_kind, kinds = model_input.value, card_model_type(model_type)[1]
    else:
        model_type, endpoint, model_path, *extra = args
        input_kind, kinds = card_model_type(model_type)
    if extra:
        model_name = extra[0]
    model = resolve_model(str(model_path), model_name=model_name)
    card = ModelDeploymentCard.from_local_model(
        model,
        model_input=input_kind,  # type: ignore[arg-type]
        model_type=kinds,  # type: ignore[arg-type]
        context_length=context_length,
        kv_cache_block_size=kv_cache_block_size,
        migration_limit=migration_limit,
        user_data=user_data,
    )
    await publish_card(endpoint, card)
    return card
