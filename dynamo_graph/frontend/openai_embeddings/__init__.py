"""OpenAI's embeddings API (`POST /v1/embeddings`), served by embedding workers."""

from dynamo_graph.frontend.openai_embeddings.serving import EmbeddingsHandler

PATH = "/v1/embeddings"

__all__ = ["PATH", "EmbeddingsHandler"]
