"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), served as chat
completions (api_surface.py)."""

from dynamo_graph.frontend.anthropic_messages.serving import CountTokensHandler, MessagesHandler

PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

__all__ = ["COUNT_TOKENS_PATH", "PATH", "CountTokensHandler", "MessagesHandler"]
