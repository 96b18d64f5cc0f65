"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Everything a client can get wrong maps to a 4xx here with the offending field named; only
our own failures are 5xx.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from typing import Any, NamedTuple

import msgspec

from dynamo_graph.runtime.errors import RequestError

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    415: "UnsupportedMediaType",
    431: "RequestHeaderFieldsTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    529: "OverloadedError",
    504: "GatewayTimeoutError",
}


class HTTPError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        error_type: str | None = None,
    ):
        """`error_type`: the OpenAI body's `type`, where the status's own name is not it."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (Retry-After, ...)
        self.error_type = error_type

    @classmethod
    def from_engine_error(cls, err: RequestError) -> HTTPError:
        retry_after = getattr(err, "retry_after_s", None)
        if retry_after is None:
            return cls(err.http_status, err.message, param=err.param, code=err.code)
        # Overload past the router's queue: 529 (or DYN_HTTP_OVERLOAD_STATUS_CODE) + Retry-After.
        return cls(
            overload_status(),
            err.message,
            code=err.code,
            headers=[(b"retry-after", str(retry_after).encode())],
            error_type="OverloadedError",
        )

    def body(self) -> bytes:
        return error_body(
            self.status, self.message, param=self.param, code=self.code, error_type=self.error_type
        )


def post_only() -> HTTPError:
    """The 405 of a route that takes only POST, with the `Allow` header RFC 9110 requires."""
    return HTTPError(405, "Use POST for this endpoint", headers=[(b"allow", b"POST")])


def overload_status() -> int:
    """`DYN_HTTP_OVERLOAD_STATUS_CODE`: 529 (default, as Anthropic and Dynamo answer when
    overloaded) or 503 for clients and balancers that only know that one."""
    raw = os.environ.get("DYN_HTTP_OVERLOAD_STATUS_CODE", "").strip()
    if raw == "503":
        return 503
    if raw not in ("", "529"):
        log.warning("DYN_HTTP_OVERLOAD_STATUS_CODE=%r: only 529 or 503; answering 529", raw)
    return 529


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
) -> bytes:
    if error_type is None:
        error_type = _STATUS_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    error = {
        "message": message,
        "type": error_type,
        "param": param,
        "code": code if code is not None else status,
    }
    return msgspec.json.encode({"error": error})


class ErrorSchema(NamedTuple):
    """An API's error body as a named JSON Schema, for the OpenAPI document."""

    name: str
    schema: dict[str, Any]


OPENAI_ERROR = ErrorSchema(
    "OpenAIError",
    {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "integer", "null"]},
                },
                "required": ["message", "type"],
            }
        },
        "required": ["error"],
    },
)


def _integral(text: str) -> int | float:
    """A JSON number with no fraction (`5.0`, `1e3`) is an integer, as JSON Schema counts it."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


_UNTYPED = msgspec.json.Decoder(float_hook=_integral)


def request_decoder(request_type: Any) -> msgspec.json.Decoder:
    """A route's request decoder: integral floats in untyped places (token-id lists) are ints."""
    return msgspec.json.Decoder(request_type, float_hook=_integral)


@functools.cache
def strict_decoder(decoder: msgspec.json.Decoder) -> msgspec.json.Decoder:
    """`decoder` refusing a request whose top level has a field its type does not declare (a
    misspelled `maxtokens` would otherwise be ignored, no limit applied). The type is a subclass,
    so `isinstance` holds. Nested objects (messages, content blocks, `nvext`) keep taking extra
    keys: clients put vendor keys there (`cache_control`), and OpenAI checks the top level."""
    lax = decoder.type
    strict = msgspec.defstruct(
        lax.__name__, [], bases=(lax,), module=lax.__module__, forbid_unknown_fields=True
    )
    return request_decoder(strict)


def decode_request(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """The body as the decoder's type; an integral float where an int is typed is taken as the int
    (a second, rare pass); anything else wrong is a 400 naming the field."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as err:  # a DecodeError too: first
        if "got `float`" not in str(err):
            raise _refusal(err, decoder.type, body) from None
    except msgspec.DecodeError as err:
        raise from_decode_error(err) from None
    try:
        return msgspec.convert(_UNTYPED.decode(body), decoder.type)
    except msgspec.ValidationError as err:
        raise _refusal(err, decoder.type, body) from None


def _refusal(err: msgspec.ValidationError, request_type: Any, body: bytes) -> HTTPError:
    if str(err).startswith(_UNKNOWN):  # at the top level: only that is strict (strict_decoder)
        return unknown_fields(request_type, body)
    return from_decode_error(err)


_UNKNOWN = "Object contains unknown field"
UNKNOWN_FIELD = "unknown_field"  # the code of that 400


def unknown_fields(request_type: Any, body: bytes) -> HTTPError:
    """The 400 of a request with fields its type does not declare: all of them, in OpenAI's
    words, each with the declared field it is closest to (the body is decoded again, on this
    error path only)."""
    known = [field.encode_name for field in msgspec.structs.fields(request_type)]
    given = _UNTYPED.decode(body)
    names = [name for name in given if name not in known]
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"`{name}` (did you mean `{close[0]}`?)" if close else f"`{name}`")
    plural = "s" if len(names) > 1 else ""
    return HTTPError(
        400,
        f"Unrecognized request argument{plural} supplied: {', '.join(hints)}",
        param=names[0],
        code=UNKNOWN_FIELD,
    )


# msgspec's messages end with " - at `$.field[0].sub`"; the path becomes the OpenAI `param`.
_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING_RE = re.compile(r"Object (missing required|contains unknown) field `(?P<field>[^`]+)`")


def from_decode_error(err: msgspec.DecodeError | msgspec.ValidationError) -> HTTPError:
    """Turn msgspec's decode/validation error into a 400 that names the field."""
    text = str(err)
    if isinstance(err, msgspec.ValidationError):
        match = _PATH_RE.search(text)
        # Dict values show as `[...]` in msgspec paths; the key itself is the useful name.
        path = match.group("path").lstrip(".").replace("[...]", "") if match else ""
        if match:
            text = text[: match.start()]
        missing = _MISSING_RE.match(text)
        if missing:
            field = missing.group("field")
            param = f"{path}.{field}" if path else field
        else:
            param = path or None
            if param:
                text = f"{text} for field `{param}`"
        return HTTPError(400, f"Invalid request: {text}", param=param, code="invalid_request")
    return HTTPError(400, f"Malformed JSON body: {text}", code="invalid_json")
