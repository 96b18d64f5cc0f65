"""Token-in/token-out generation (`POST /inference/v1/generate`, vLLM's shape)."""

from dynamo_graph.frontend.generate_tokens.serving import GenerateTokensHandler

PATH = "/inference/v1/generate"

__all__ = ["PATH", "GenerateTokensHandler"]
