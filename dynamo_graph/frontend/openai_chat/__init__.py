"""OpenAI's chat completions API (`POST /v1/chat/completions`): messages in, through the model's
chat template, tool-call and reasoning parsers; the other chat-shaped surfaces run on it."""

from dynamo_graph.frontend.openai_asgi import Route, Surface
from dynamo_graph.frontend.openai_chat.serving import ChatHandler

SURFACE = Surface((Route("/v1/chat/completions", ChatHandler, "Create a chat completion (OpenAI)"),))

__all__ = ["SURFACE"]
