"""OpenAI's embeddings API (`POST /v1/embeddings`), served by embedding workers."""

from dynamo_graph.frontend.openai_asgi import Route, Surface
from dynamo_graph.frontend.openai_embeddings.serving import EmbeddingsHandler

SURFACE = Surface((Route("/v1/embeddings", EmbeddingsHandler, "Create embeddings (OpenAI)"),))

__all__ = ["SURFACE"]
