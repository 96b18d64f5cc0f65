"""The distributed runtime: discovery, request plane, event plane and the worker API.

Names load lazily so that importing a small piece (e.g. runtime.context) does not pull in the
transports and their clients.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Client": "dynamo_graph.runtime.client",
    "Component": "dynamo_graph.runtime.runtime",
    "Context": "dynamo_graph.runtime.context",
    "DistributedRuntime": "dynamo_graph.runtime.runtime",
    "Endpoint": "dynamo_graph.runtime.runtime",
    "EndpointName": "dynamo_graph.runtime.names",
    "Namespace": "dynamo_graph.runtime.runtime",
    "dynamo_worker": "dynamo_graph.runtime.worker",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dynamo_graph.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
