"""CURVE on the zmq event plane: KV events and load reports encrypted, and only the graph's
processes may subscribe.

DYN_ZMQ_CURVE_KEY_FILE (runtime/settings.py) names a file holding the graph's CURVE secret key
(z85, 40 characters; a graph with `security.tls` on makes it beside its CA, graph/tls.py). Every
process of the graph holds the same key pair: a publisher is a CURVE server with it, a subscriber
a CURVE client that presents it and expects it of the publisher, and the publisher's ZAP handler
admits only a client presenting it. A subscriber without the file cannot complete the handshake,
so it reads nothing; a publisher without it cannot talk to the graph's subscribers (nor announce
itself in etcd, which wants the graph's certificate).

Why CURVE and not TLS: libzmq has no TLS transport (only CURVE, or a TLS proxy in front); CURVE
gives each connection fresh session keys (forward secrecy) from long-term ones, like TLS 1.3. One
key pair per graph rather than one per process: a publisher would otherwise have to learn every
member's public key to admit it, and membership is what the graph's certificates already decide.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

ENV = "DYN_ZMQ_CURVE_KEY_FILE"

_lock = threading.Lock()
_authenticators: dict[int, tuple[ThreadAuthenticator, _Members]] = {}  # id(context) -> its ZAP handler


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The graph's CURVE key pair (z85 bytes)."""

    secret: bytes
    public: bytes

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CurveKeys | None:
        """The key pair of the file DYN_ZMQ_CURVE_KEY_FILE names in `env` (default: this
        process's); None when unset. ValueError for a missing file or one without a z85 key."""
        path = ((os.environ if env is None else env).get(ENV) or "").strip()
        return cls.from_file(path) if path else None

    @classmethod
    def from_file(cls, path: str) -> CurveKeys:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{ENV}={path}: {exc.strerror}") from None
        if len(secret) != 40:
            raise ValueError(f"{ENV}={path}: not a CURVE secret key (40 z85 characters)")
        return cls(secret, zmq.curve_public(secret))

    def serve(self, sock: zmq.Socket[bytes], context: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Make `sock` (before bind) a CURVE server that admits only holders of the key pair."""
        _admit_only(context, self.public)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect_as_member(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (before connect) a CURVE client presenting the key pair and expecting it
        of the server."""
        sock.curve_serverkey = self.public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class _Members:
    """The public keys a context's publishers serve: one graph's in a graph process; a process
    that publishes for several key pairs (tests) admits each one's holders."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key in self.keys


def _admit_only(context: zmq.Context[zmq.Socket[bytes]], public: bytes) -> None:
    """Start `context`'s ZAP handler (once) and admit CURVE clients presenting `public`; others not."""
    with _lock:
        if id(context) not in _authenticators:
            # The handler's thread blocks on its own sockets: a plain context over the same
            # libzmq one (`context` may be an asyncio one), which is where ZAP requests go.
            auth = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
            auth.start()
            members = _Members()
            auth.configure_curve_callback("*", members)
            _authenticators[id(context)] = (auth, members)
        _authenticators[id(context)][1].keys.add(public)
