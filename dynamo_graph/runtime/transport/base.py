"""The request plane: one request in, a stream of frames out, cancellable from the caller.

Two transports behind this interface (docs/contracts.md, "Request-plane frames"): `tcp` (the default: one
listener per worker process, msgpack frames, streams multiplexed per connection) and `nats`
(a subject per endpoint instance, responses streamed to an inbox). Payloads are opaque bytes
here (the runtime encodes them with msgspec); a stream always ends with exactly one terminal
frame, which the client turns into normal completion or a typed exception.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from typing import Any

from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import RequestError

# A served endpoint: (payload bytes, headers, context) -> async iterator of response payloads.
# Raising an RequestError sends its code and message as the terminal error frame.
Handler = Callable[[bytes, dict[str, str], Context], AsyncIterator[bytes]]


class TransportError(RequestError):
    """The request plane failed (not the engine); these are what request migration retries."""

    code = "transport"
    http_status = 503


class CannotConnect(TransportError):
    """The instance could not be reached before the stream opened (nothing was generated)."""

    code = "cannot_connect"


class StreamBroken(TransportError):
    """The stream ended without a terminal frame: the worker died or the connection was lost."""

    code = "disconnected"


class RequestTimeout(TransportError):
    """The instance did not answer within the request's time limit."""

    code = "timeout"
    http_status = 504


class RequestPlaneServer(abc.ABC):
    """The worker side. One per process, serving any number of endpoint instances."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def register(self, subject: str, handler: Handler) -> dict[str, Any]:
        """Serve `subject` (e.g. "ns.comp.ep-<instance hex>") and return the transport record
        to publish in the instance's discovery entry, e.g. {"tcp": "127.0.0.1:4321"}."""

    @abc.abstractmethod
    def unregister(self, subject: str) -> None:
        """Stop taking new requests for `subject`; streams in flight go on."""

    @abc.abstractmethod
    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop listening; wait up to grace_s for streams in flight, then end them."""


class RequestPlaneClient(abc.ABC):
    """The caller side. Connections are created on first use and reused."""

    @abc.abstractmethod
    def stream(
        self,
        transport: dict[str, Any],
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        context: Context,
        timeout_s: float | None = None,
    ) -> AsyncIterator[bytes]:
        """Send one request and yield its response payloads. `context.stop_generating()` sends a
        cancel frame to the worker. Raises CannotConnect / StreamBroken / RequestTimeout, or the
        worker's RequestError (rebuilt from its code)."""

    @abc.abstractmethod
    async def close(self) -> None: ...
