"""OpenAI's Responses API (`POST /v1/responses`), served as chat completions (api_surface.py)."""

from dynamo_graph.frontend.openai_asgi import Route, Surface
from dynamo_graph.frontend.openai_responses.serving import ResponsesHandler

SURFACE = Surface((Route("/v1/responses", ResponsesHandler, "Create a response (OpenAI Responses API)"),))

__all__ = ["SURFACE"]
