"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), served as chat
completions (api_surface.py)."""

from dynamo_graph.frontend.anthropic_messages.events import ANTHROPIC_ERROR
from dynamo_graph.frontend.anthropic_messages.serving import CountTokensHandler, MessagesHandler
from dynamo_graph.frontend.openai_asgi import Route, Surface

SURFACE = Surface(
    (
        Route("/v1/messages", MessagesHandler, "Create a message (Anthropic Messages API)"),
        Route("/v1/messages/count_tokens", CountTokensHandler, "Count a message's input tokens (Anthropic)"),
    ),
    error=ANTHROPIC_ERROR,
)

__all__ = ["SURFACE"]
