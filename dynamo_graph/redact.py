"""Keeping secrets out of what people see: rendered plans, logs and error messages.

A name (environment variable, option) that looks secret has its value replaced by `***`;
the user-info part of a URL (`nats://user:password@host`, a token as the user) likewise.
"""

from __future__ import annotations

import re

REDACTED = "***"
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE", "AUTH")
# Names that hold where a secret is (a variable's name, a file), not the secret itself.
_NOT_SECRET_SUFFIXES = ("_ENV", "_FILE", "_PATH", "_DIR", "_BLOCK_SIZE")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s]+)@")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable, option or key named `name` likely holds a secret."""
    upper = name.strip("-").upper().replace("-", "_")
    return any(word in upper for word in _SECRET_WORDS) and not upper.endswith(_NOT_SECRET_SUFFIXES)


def redact_url(text: str) -> str:
    """`scheme://user:password@host` (or a token as the user) -> `scheme://***@host`."""
    if "@" not in text:
        return text
    return _URL_USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", text)
