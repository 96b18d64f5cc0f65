"""OpenAI's completions API (`POST /v1/completions`): a prompt (text or token ids) in, text out."""

from dynamo_graph.frontend.openai_completions.serving import CompletionsHandler

PATH = "/v1/completions"

__all__ = ["PATH", "CompletionsHandler"]
