"""The router's per-request hints from HTTP headers: `x-session-id` (session affinity) and
`x-dynamo-request-priority` (the router queue's order; an integer, higher is more urgent).

As in Dynamo, a header overrides the same hint in the body (`nvext.agent_context.session_id`,
`nvext.agent_hints.priority`). A priority that is not an integer is the client's 400, naming the
header, rather than a silently ignored hint.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from dynamo_graph.frontend.errors import HTTPError
from dynamo_graph.llm.protocol import PreprocessedRequest, RoutingHints

SESSION_HEADER = b"x-session-id"
PRIORITY_HEADER = b"x-dynamo-request-priority"
MAX_SESSION_ID = 256
_PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # Dynamo reads it as an i32


def apply_routing_headers(
    request: PreprocessedRequest | None, headers: Iterable[tuple[bytes, bytes]]
) -> None:
    session: str | None = None
    priority: int | None = None
    for name, value in headers:
        if name == SESSION_HEADER:
            session = value.decode("latin-1").strip()
            if len(session) > MAX_SESSION_ID:
                raise HTTPError(
                    400,
                    f"x-session-id must be at most {MAX_SESSION_ID} characters",
                    param="x-session-id",
                    code="invalid_request",
                )
        elif name == PRIORITY_HEADER:
            try:
                priority = int(value.strip())
            except ValueError:
                priority = None
            if priority is None or not _PRIORITY_RANGE[0] <= priority <= _PRIORITY_RANGE[1]:
                raise HTTPError(
                    400,
                    "x-dynamo-request-priority must be a 32-bit integer (higher is more urgent), "
                    f"not {value.decode('latin-1')[:40]!r}",
                    param="x-dynamo-request-priority",
                    code="invalid_request",
                )
    if request is None or (not session and priority is None):
        return
    hints = request.routing or RoutingHints()
    if session:
        hints = msgspec.structs.replace(hints, session_id=session)
    if priority is not None:
        hints = msgspec.structs.replace(hints, priority=priority)
    request.routing = hints
