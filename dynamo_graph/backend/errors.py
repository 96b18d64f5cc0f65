"""The errors an engine raises, by the names engine authors know them.

They are the runtime's wire error kinds (runtime/errors.py) under the engine contract's names:
an engine raising `InvalidArgument` ends its stream with an `invalid_argument` error frame and
the client gets a 400; `EngineOverloaded` (503) sends the request to another instance;
`EngineShutdown` (503) lets it migrate; any other `EngineError` or exception is a 500.
"""

from __future__ import annotations

from dynamo_graph.runtime.errors import InvalidArgument, NotFound, Overloaded, RequestError, ShuttingDown

EngineError = RequestError
ModelNotFound = NotFound
EngineShutdown = ShuttingDown
EngineOverloaded = Overloaded

__all__ = ["EngineError", "EngineOverloaded", "EngineShutdown", "InvalidArgument", "ModelNotFound"]
