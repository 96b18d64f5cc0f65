"""The error kinds that travel on the request plane, as (code, message, param).

A handler that raises one of these ends its stream with an error frame carrying the code; the
caller's side rebuilds the same type from it (`error_from_code`), so a bad argument found deep
in a worker is still the client's 400. `http_status` is the status class of each kind (what an
HTTP edge answers); the runtime itself only routes on the kind: `Overloaded` before any
response sends the request elsewhere, `ShuttingDown` and broken streams are what migration
retries. The backend names these for engines (backend/errors.py).
"""

from __future__ import annotations


class RequestError(Exception):
    """A request failed; the base of every kind (code `internal`, status 500)."""

    code = "internal"
    http_status = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidArgument(RequestError):
    """A bad argument found where the request is served: the client's 400."""

    code = "invalid_argument"
    http_status = 400


class NotFound(RequestError):
    """What the request names (a model, an adapter) is not served here: the client's 404."""

    # The wire code is OpenAI's for an unknown model, the one thing callers ask for by name.
    code = "model_not_found"
    http_status = 404


class ShuttingDown(RequestError):
    """The serving process is stopping: the request may continue elsewhere."""

    code = "engine_shutdown"
    http_status = 503


class Overloaded(RequestError):
    """The instance is at its limit; nothing was done, so another instance may take it."""

    code = "overloaded"
    http_status = 503


_BY_CODE: dict[str, type[RequestError]] = {
    cls.code: cls for cls in (RequestError, InvalidArgument, NotFound, ShuttingDown, Overloaded)
}


def error_from_code(code: str, message: str, param: str | None = None) -> RequestError:
    """Rebuild a typed error received as (code, message) from a remote handler."""
    return _BY_CODE.get(code, RequestError)(message, param=param)
