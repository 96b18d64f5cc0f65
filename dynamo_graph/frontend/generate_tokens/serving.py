"""`POST /inference/v1/generate`: token ids in, token ids out, through the shared pipeline.

The request runs as a completions request whose prompt is its token ids, on the completions
route's own handler (openai_asgi.py): the same routing (kv included), migration, limits, API keys,
request timeout, cancellation on disconnect and metrics (endpoint `generate`). Only the output
differs: the pipeline streams the engine's ids (llm/token_output.py) — no chat template on the
way in, no detokenizer on the way out. Tokens-input models only: a text-input model's worker
never sees token ids.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dynamo_graph.frontend.errors import HTTPError, request_decoder
from dynamo_graph.frontend.generate_tokens.events import TokensWriter
from dynamo_graph.frontend.generate_tokens.protocol import PARAM_NAMES, GenerateRequest, to_completion
from dynamo_graph.frontend.openai_asgi import OpenAIHandler
from dynamo_graph.llm.openai import AnyRequest, CompletionRequest
from dynamo_graph.llm.pipeline import ModelPipeline, Prepared, TokensPipeline


class GenerateTokensHandler(OpenAIHandler):
    """Serves `/inference/v1/generate` for every tokens-input model that serves completions."""

    kind = "completions"
    endpoint = "generate"
    decoder = request_decoder(GenerateRequest)
    param_names: ClassVar[dict[str, str]] = PARAM_NAMES

    def convert(self, request: GenerateRequest) -> CompletionRequest:
        model = request.model
        if model is None:
            names = self.models.names()
            if len(names) != 1:
                raise HTTPError(
                    400,
                    "model is required: this server serves several models",
                    param="model",
                    code="model_required",
                )
            model = names[0]
        return to_completion(request, model)

    @staticmethod
    def _prepare(pipeline: ModelPipeline, request: AnyRequest) -> Prepared:
        if not isinstance(pipeline, TokensPipeline):
            raise HTTPError(
                404,
                f"The model `{pipeline.name}` takes text: token-in/token-out needs a tokens-input model",
                param="model",
                code="wrong_endpoint",
            )
        prepared = OpenAIHandler._prepare(pipeline, request)
        prepared.tokens_out = True
        return prepared

    def writer(self, request: Any, prepared: Prepared) -> TokensWriter:
        opts = request.stream_options
        usage = not request.stream or (opts is not None and opts.include_usage)
        return TokensWriter(
            request.model or prepared.request.model, request.request_id, prepared, usage=usage
        )

    def answer(self, request: Any, prepared: Prepared) -> TokensWriter:
        """The writer gathers the whole answer too."""
        return self.writer(request, prepared)
