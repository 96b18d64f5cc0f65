"""OpenAI's chat completions API (`POST /v1/chat/completions`): messages in, through the model's
chat template, tool-call and reasoning parsers; the other chat-shaped surfaces run on it."""

from dynamo_graph.frontend.openai_chat.serving import ChatHandler

PATH = "/v1/chat/completions"

__all__ = ["PATH", "ChatHandler"]
