"""Endpoint names (`dyn://namespace.component.endpoint`), instance ids and discovery keys.

Missing parts default as dynamo-run does: `dyn://test` is `test.backend.generate`,
`dyn://test.worker` is `test.worker.generate`. Keys follow Dynamo's layout (docs/contracts.md):
`v1/instances/{ns}/{comp}/{ep}/{instance_id:x}` and `v1/mdc/...`; a LoRA adapter's card sits
one level deeper, `v1/mdc/{ns}/{comp}/{ep}/{instance_id:x}/{adapter slug}`, as in Dynamo.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

DEFAULT_COMPONENT = "backend"
DEFAULT_ENDPOINT = "generate"
INSTANCES_ROOT = "v1/instances"
MDC_ROOT = "v1/mdc"

_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")


class NameError_(ValueError):
    """A namespace, component or endpoint name that is not allowed."""


def _check_part(kind: str, value: str, text: str) -> str:
    if not _PART.match(value):
        raise NameError_(
            f"{text!r}: {kind} {value!r} must be letters, digits, '_' or '-' (and not start with '-')"
        )
    return value


@dataclass(frozen=True, slots=True)
class EndpointName:
    namespace: str
    component: str = DEFAULT_COMPONENT
    endpoint: str = DEFAULT_ENDPOINT

    @classmethod
    def parse(cls, text: str) -> EndpointName:
        """`dyn://ns[.comp[.ep]]` (the scheme is optional)."""
        body = text.removeprefix("dyn://")
        if not body:
            raise NameError_(f"{text!r}: expected dyn://namespace.component.endpoint")
        parts = body.split(".")
        if len(parts) > 3:
            raise NameError_(f"{text!r}: at most three parts, dyn://namespace.component.endpoint")
        kinds = ("namespace", "component", "endpoint")
        checked = [_check_part(kind, part, text) for kind, part in zip(kinds, parts, strict=False)]
        return cls(*checked)

    @property
    def path(self) -> str:
        return f"{self.namespace}/{self.component}/{self.endpoint}"

    def __str__(self) -> str:
        return f"dyn://{self.namespace}.{self.component}.{self.endpoint}"

    def instance_key(self, instance_id: int) -> str:
        return f"{INSTANCES_ROOT}/{self.path}/{instance_id:x}"

    def card_key(self, instance_id: int, adapter_slug: str | None = None) -> str:
        """The instance's model card, or with `adapter_slug` the card of a LoRA adapter it serves."""
        key = f"{MDC_ROOT}/{self.path}/{instance_id:x}"
        return key if adapter_slug is None else f"{key}/{adapter_slug}"

    def instances_prefix(self) -> str:
        return f"{INSTANCES_ROOT}/{self.path}/"


def new_instance_id() -> int:
    """A random non-zero 63-bit id (positive as a signed 64-bit number, as etcd lease ids are)."""
    return secrets.randbits(63) or 1


def instance_id_from_key(key: str) -> int:
    """The instance id is the key's sixth segment in hex, the last but for an adapter's card key
    (a delete event carries only the key)."""
    parts = key.split("/")
    return int(parts[5] if len(parts) > 5 else parts[-1], 16)


def adapter_slug_from_key(key: str) -> str | None:
    """The LoRA adapter slug of an adapter's card key; None for any other key."""
    parts = key.split("/")
    return parts[6] if len(parts) == 7 else None


def endpoint_from_key(key: str) -> EndpointName:
    """`v1/{bucket}/{ns}/{comp}/{ep}/{id}[/{adapter}]` -> the endpoint name."""
    parts = key.split("/")
    if len(parts) != 6 and not (len(parts) == 7 and f"{parts[0]}/{parts[1]}" == MDC_ROOT):
        raise NameError_(f"not an instance or card key: {key!r}")
    return EndpointName(parts[2], parts[3], parts[4])
