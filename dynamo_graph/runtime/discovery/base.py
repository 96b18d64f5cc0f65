"""Discovery: a key-value store whose keys live as long as the process that wrote them.

Two backends behind this one interface (docs/contracts.md, "Discovery keys"): `file` (the embedded default,
no services: a directory of JSON records kept alive by heartbeats) and `etcd` (one lease per
process with keepalive). Keys follow runtime/names.py; values are JSON bytes.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal


class DiscoveryError(Exception):
    """Discovery is misconfigured or its store cannot be used (the message says which)."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes | None  # None for deletes: a delete carries only the key


class Discovery(abc.ABC):
    """Every key this process puts is attached to its lease: when the process dies or loses the
    lease for longer than the TTL, its keys disappear for everyone."""

    backend: str

    @property
    @abc.abstractmethod
    def lease_id(self) -> int:
        """This process's lease (etcd's lease id; a random id for the file backend). Valid after
        start(); it may change if the lease is lost and granted again."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect, grant the lease and start keeping it alive."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes) -> None:
        """Create or replace a key under this process's lease (re-put after a lease re-grant)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove one of this process's keys."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every live key under `prefix`."""

    @abc.abstractmethod
    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """List then watch: first a put for every existing key, then every change, with nothing
        missed in between and across reconnects. Ends only when the discovery is closed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Revoke the lease (this process's keys go at once) and stop background tasks."""
