"""Optional API keys on the frontend.

Keys come from `--api-key KEY[,KEY...]`, the environment variable `DYN_API_KEY` (a comma list,
as vLLM's `VLLM_API_KEY`), and the variables named in `DYN_API_KEY_ENV` (a comma list of names;
how a graph's `api_key_env` reaches the frontend, so keys never appear in a graph, a plan or a
command line). With any key set, every `/v1/...` route needs `Authorization: Bearer KEY` (or
`x-api-key: KEY`); `/health`, `/live`, `/metrics` and the API docs stay open. A wrong or missing
key is a 401 with OpenAI's body (`code: invalid_api_key`).

A keys file of tenants (frontend/tenants.py, `--api-keys-file`) works beside these keys: a key of
the file authenticates as its tenant, with the tenant's models, limits and cache salt; a key given
here is no tenant's and has no such limits.

Keys are held only as SHA-256 digests and compared with `hmac.compare_digest` against every key,
so neither the time taken nor anything logged says which key, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any, Protocol

from dynamo_graph.frontend.errors import HTTPError

API_KEY_ENV = "DYN_API_KEY"
API_KEY_ENV_NAMES = "DYN_API_KEY_ENV"
PROTECTED_PREFIX = ("/v1/", "/inference/")

UNAUTHORIZED_HEADERS = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]


class Guard(Protocol):
    """What the OpenAPI document asks of the keys: which routes need one."""

    def protects(self, path: str) -> bool: ...


def protected_path(path: str) -> bool:
    """The routes a key is needed for: the API's, never the probes, /metrics or the docs."""
    return path.startswith(PROTECTED_PREFIX) or path == "/v1"


def _split(raw: str | None) -> list[str]:
    return [part.strip() for part in (raw or "").split(",") if part.strip()]


def keys_from_settings(flag: str | None, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Every accepted key: the flag's, DYN_API_KEY's and those in the variables DYN_API_KEY_ENV
    names. A named variable that is unset or empty is an error: a frontend meant to be protected
    must not come up open."""
    env = os.environ if environ is None else environ
    keys = _split(flag) + _split(env.get(API_KEY_ENV))
    for name in _split(env.get(API_KEY_ENV_NAMES)):
        value = _split(env.get(name))
        if not value:
            raise ValueError(
                f"{API_KEY_ENV_NAMES} names {name}, which is not set or empty: set it to the API key "
                "(or a comma list of keys) the frontend accepts"
            )
        keys += value
    return keys


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeys:
    """The accepted keys, as digests; `check` takes the raw ASGI headers."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(dict.fromkeys(_digest(k) for k in keys if k))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"ApiKeys({len(self._digests)} keys)"

    def protects(self, path: str) -> bool:
        return bool(self._digests) and protected_path(path)

    @staticmethod
    def presented(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    return token.strip()
                return None
            if name == b"x-api-key":
                return value.strip()
        return None

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        return self.matches(self.presented(headers))

    def matches(self, token: bytes | None) -> bool:
        """Whether `token` (as presented) is one of the keys."""
        if not token:
            return False
        given = _digest(token)
        ok = False
        for digest in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(digest, given)
        return ok


def unauthorized_error(missing: bool) -> HTTPError:
    if missing:
        message = (
            "You didn't provide an API key. You need to provide your API key in an Authorization "
            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    else:
        message = "Incorrect API key provided."  # never echo any of the key back
    return HTTPError(401, message, code="invalid_api_key", error_type="invalid_request_error")


async def send_unauthorized(
    send: Any, headers: Iterable[tuple[bytes, bytes]], render: Callable[[HTTPError], bytes] | None = None
) -> None:
    """The 401, its body as `render` (the route's API) makes it; OpenAI's by default."""
    err = unauthorized_error(ApiKeys.presented(headers) is None)
    body = err.body() if render is None else render(err)
    await send({"type": "http.response.start", "status": 401, "headers": UNAUTHORIZED_HEADERS})
    await send({"type": "http.response.body", "body": body})
