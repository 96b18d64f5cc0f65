"""The models a frontend serves, by the name clients put in `model`."""

from __future__ import annotations

import time
from collections.abc import Callable

from dynamo_graph.llm.pipeline import ModelPipeline

# Describes the worker instances behind a model, for /health: [{"instance_id": hex, ...}].
InstancesReport = Callable[[], list[dict]]


class ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, ModelPipeline] = {}
        self._created: dict[str, int] = {}
        self._instances: dict[str, InstancesReport] = {}

    def add(self, pipeline: ModelPipeline, instances: InstancesReport | None = None) -> None:
        self._models[pipeline.name] = pipeline
        self._created.setdefault(pipeline.name, int(time.time()))
        if instances is not None:
            self._instances[pipeline.name] = instances

    def remove(self, name: str) -> None:
        self._models.pop(name, None)
        self._created.pop(name, None)
        self._instances.pop(name, None)

    def health(self) -> dict[str, dict]:
        """Per model: where it runs and, for remote models, its worker instances."""
        report = {}
        for name in self.names():
            instances = self._instances.get(name)
            report[name] = {"instances": instances()} if instances else {"instances": "in-process"}
        return report

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
