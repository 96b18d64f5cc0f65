"""Typed errors an engine (or anything behind the frontend) raises, with their wire codes.

The code travels on the request plane; the frontend turns it into an HTTP status and an
OpenAI-style error body, so a bad argument found deep in an engine is still the client's 400.
"""

from __future__ import annotations


class EngineError(Exception):
    code = "internal"
    http_status = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidArgument(EngineError):
    code = "invalid_argument"
    http_status = 400


class ModelNotFound(EngineError):
    code = "model_not_found"
    http_status = 404


class EngineShutdown(EngineError):
    code = "engine_shutdown"
    http_status = 503


class EngineOverloaded(EngineError):
    code = "overloaded"
    http_status = 503


_BY_CODE: dict[str, type[EngineError]] = {
    cls.code: cls for cls in (EngineError, InvalidArgument, ModelNotFound, EngineShutdown, EngineOverloaded)
}


def error_from_code(code: str, message: str, param: str | None = None) -> EngineError:
    """Rebuild a typed error received as (code, message) from a remote worker."""
    return _BY_CODE.get(code, EngineError)(message, param=param)
