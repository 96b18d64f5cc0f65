"""OpenAI's completions API (`POST /v1/completions`): a prompt (text or token ids) in, text out."""

from dynamo_graph.frontend.openai_asgi import Route, Surface
from dynamo_graph.frontend.openai_completions.serving import CompletionsHandler

SURFACE = Surface((Route("/v1/completions", CompletionsHandler, "Create a completion (OpenAI)"),))

__all__ = ["SURFACE"]
