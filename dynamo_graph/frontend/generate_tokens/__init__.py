"""Token-in/token-out generation (`POST /inference/v1/generate`, vLLM's shape)."""

from dynamo_graph.frontend.generate_tokens.serving import GenerateTokensHandler
from dynamo_graph.frontend.openai_asgi import Route, Surface

SURFACE = Surface(
    (
        Route(
            "/inference/v1/generate",
            GenerateTokensHandler,
            "Generate token ids from token ids (vLLM's shape)",
        ),
    )
)

__all__ = ["SURFACE"]
