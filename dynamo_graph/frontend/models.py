"""The models a frontend serves, by the name clients put in `model`.

`/health` (frontend/app.py) reports, per model, `status` (`healthy` while requests have an
instance to go to), `instances` (the routable ones, each with `state: healthy`, the requests
sent to it and its last health check) and `unavailable` (known instances left out of routing:
`unhealthy` with the failed check's reason, `cooling_off` after a failed connection, `refused`
for a model card mismatch; each with `since`). In-process models have `instances: "in-process"`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dynamo_graph.llm.embeddings import EmbeddingPipeline
from dynamo_graph.llm.pipeline import ModelPipeline, TokensPipeline

AnyPipeline = ModelPipeline | EmbeddingPipeline

# The routes that serve each model type. Counting a message's tokens needs the frontend's own
# template and tokenizer: a tokens-input model's.
CHAT_ENDPOINTS = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]
COMPLETIONS_ENDPOINTS = ["/v1/completions"]
EMBEDDING_ENDPOINTS = ["/v1/embeddings"]
TOKENS_ENDPOINT = "/inference/v1/generate"  # token-in/token-out: tokens-input models


def endpoints(pipeline: AnyPipeline) -> list[str]:
    """The routes that serve this model (`/v1/models` lists them)."""
    types = pipeline.card.model_type
    routes = list(CHAT_ENDPOINTS) if "chat" in types else []
    if "chat" in types and isinstance(pipeline, TokensPipeline):
        routes.append("/v1/messages/count_tokens")
    if "completions" in types:
        routes += COMPLETIONS_ENDPOINTS
        if isinstance(pipeline, TokensPipeline):
            routes.append(TOKENS_ENDPOINT)
    if "embedding" in types:
        routes += EMBEDDING_ENDPOINTS
    return routes


# Describes the worker instances behind a model, for /health: the routable ones as
# [{"instance_id": hex, ...}], or {"instances": [...], "unavailable": [...]} (Client.health_report).
InstancesReport = Callable[[], list[dict] | dict[str, Any]]


class ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, AnyPipeline] = {}
        self._created: dict[str, int] = {}
        self._instances: dict[str, InstancesReport] = {}
        self._routable: dict[str, Callable[[], bool]] = {}

    def add(
        self,
        pipeline: AnyPipeline,
        instances: InstancesReport | None = None,
        routable: Callable[[], bool] | None = None,
    ) -> None:
        """`routable`: whether a request for the model has a worker to go to now (a remote
        model's workers may all be gone for a while, frontend/model_watcher.py); None: always."""
        self._models[pipeline.name] = pipeline
        self._created.setdefault(pipeline.name, int(time.time()))
        if instances is not None:
            self._instances[pipeline.name] = instances
        if routable is not None:
            self._routable[pipeline.name] = routable

    def remove(self, name: str) -> None:
        self._models.pop(name, None)
        self._created.pop(name, None)
        self._instances.pop(name, None)
        self._routable.pop(name, None)

    def routable(self, name: str) -> bool:
        """A listed model with a worker to send a request to now (an in-process one always)."""
        if name not in self._models:
            return False
        check = self._routable.get(name)
        return check is None or check()

    def health(self) -> dict[str, dict]:
        """Per model: its status, where it runs and, for remote models, its worker instances."""
        report: dict[str, dict] = {}
        for name in self.names():
            instances = self._instances.get(name)
            if instances is None:
                report[name] = {"status": "healthy", "instances": "in-process"}
                continue
            found = instances()
            entry = dict(found) if isinstance(found, dict) else {"instances": found}
            report[name] = {"status": "healthy" if entry.get("instances") else "unhealthy", **entry}
        return report

    def get(self, name: str) -> AnyPipeline | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return sorted(self._models)

    def list_models(self) -> list[dict]:
        return [
            {
                "id": name,
                "object": "model",
                "created": self._created[name],
                "owned_by": "dyngraph",
                "context_window": self._models[name].card.context_length,
                "endpoints": endpoints(self._models[name]),
                # A LoRA adapter's base model, as vLLM lists it; None for a base model.
                "parent": _parent(self._models[name]),
            }
            for name in self.names()
        ]


def _parent(pipeline: ModelPipeline) -> str | None:
    lora = pipeline.card.lora
    return None if lora is None else lora.base_model
