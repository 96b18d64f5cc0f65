"""The models a frontend serves, by the name clients put in `model`."""

from __future__ import annotations

import time

from dynamo_graph.llm.pipeline import ModelPipeline


class ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, ModelPipeline] = {}
        self._created: dict[str, int] = {}

    def add(self, pipeline: ModelPipeline) -> None:
        self._models[pipeline.name] = pipeline
        self._created.setdefault(pipeline.name, int(time.time()))

    def remove(self, name: str) -> None:
        self._models.pop(name, None)
        self._created.pop(name, None)

    def get(self, name: str) -> ModelPipeline | None:
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
            }
            for name in self.names()
        ]
