"""The control channel of a running supervisor: a unix socket in the state dir.

One request per connection, one JSON line each way (msgspec):

    {"op": "apply", "plan": <Plan>, "origin": <Origin>}
                                      -> {"ok": true, "changes": ["+ backend-2", ...], "revision": 4}
    {"op": "stop"}                    -> {"ok": true}   (stopping continues; the supervisor exits)

`status` needs no request: the supervisor rewrites processes.json on every change. The socket
is made mode 0600: only its user can drive the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local.revisions import Origin

REQUEST_TIMEOUT_S = 30.0


class Apply(msgspec.Struct, tag="apply", tag_field="op"):
    plan: Plan
    origin: Origin  # recorded with the revision (revisions.py)


class Stop(msgspec.Struct, tag="stop", tag_field="op"):
    pass


Request = Apply | Stop


class Reply(msgspec.Struct):
    ok: bool
    changes: list[str] = []
    revision: int = 0  # the revision applying the changes (the serving one when none)
    error: str = ""


class ControlError(Exception):
    """The supervisor could not be reached or refused the request."""


async def serve(path: Path, handle: Callable[[Request], Awaitable[Reply]]) -> asyncio.Server:
    """Listen on `path`; `handle` runs in the event loop (it must not block)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket of a supervisor that died

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if not line:
                return  # a liveness check (`reachable`) connects and hangs up
            try:
                reply = await handle(msgspec.json.decode(line, type=Request))
            except msgspec.ValidationError as e:
                reply = Reply(ok=False, error=f"bad request: {e}")
            except Exception as e:  # a refused plan must not take the supervisor down
                reply = Reply(ok=False, error=str(e))
            writer.write(msgspec.json.encode(reply) + b"\n")
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_unix_server(on_client, path=str(path))
    os.chmod(path, 0o600)
    return server


def request(path: Path, req: Request, timeout: float = REQUEST_TIMEOUT_S) -> Reply:
    """Send one request and wait for its reply; raises ControlError."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(msgspec.json.encode(req) + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        raise ControlError(f"cannot reach the supervisor at {path}: {e}") from e
    try:
        reply = msgspec.json.decode(data, type=Reply)
    except msgspec.DecodeError as e:
        raise ControlError(f"bad reply from the supervisor: {data[:200]!r}") from e
    if not reply.ok:
        raise ControlError(reply.error)
    return reply


def reachable(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(str(path)) == 0
