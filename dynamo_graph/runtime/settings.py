"""The runtime's planes as `dyngraph run` flags, declared once (dynamo_graph/options.py).

None leaves the environment (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE, DYN_EVENT_PLANE) in
charge; a value given is written there (`to_env`), so every part of the runtime and every
child process sees one configuration, and discovery/transport check it where they read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dynamo_graph.options import options, setting


@dataclass(frozen=True, slots=True)
class PlaneSettings:
    """Which discovery backend, request plane and event plane a process uses."""

    discovery_backend: str | None = setting(None, flag="--discovery-backend", in_graph=False)
    """file | etcd (env DYN_DISCOVERY_BACKEND)."""
    request_plane: str | None = setting(None, flag="--request-plane", in_graph=False)
    """tcp | nats (env DYN_REQUEST_PLANE)."""
    event_plane: str | None = setting(None, flag="--event-plane", in_graph=False)
    """zmq | nats | inproc (env DYN_EVENT_PLANE)."""

    def to_env(self) -> None:
        for opt in options(PlaneSettings):
            value = getattr(self, opt.name)
            if value is not None:
                os.environ[f"DYN_{opt.name.upper()}"] = value
