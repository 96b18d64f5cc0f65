"""OpenAI's Responses API (`POST /v1/responses`), served as chat completions (api_surface.py)."""

from dynamo_graph.frontend.openai_responses.serving import ResponsesHandler

PATH = "/v1/responses"

__all__ = ["PATH", "ResponsesHandler"]
