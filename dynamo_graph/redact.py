"""Keeping secrets out of what people see: rendered plans, logs and error messages.

A name (environment variable, option) that looks secret has its value replaced by `***`;
the user-info part of a URL (`nats://user:password@host`, a token as the user) likewise.
"""

from __future__ import annotations

import re

REDACTED = "***"
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE", "AUTH")
# Words that contain a secret word but name counts and tools (`--max-tokens`, `--tokenizer`).
_NOT_SECRET_WORDS = frozenset({"TOKENS", "TOKENIZER", "TOKENIZERS"})
# Names that hold where a secret is (a variable's name, a file), or a quantity, not the secret.
_NOT_SECRET_SUFFIXES = ("_ENV", "_FILE", "_PATH", "_DIR", "_BLOCK_SIZE", "_MS", "_SECS", "_SECONDS", "_COUNT")
# Names of a PEM file's path (the TLS files a graph gives etcd, nats-server and their clients: the
# key stays in the file) or of the TLS server name, not of a secret.
_NOT_SECRET_NAMES = frozenset(
    {
        "ETCD_AUTH_CA",
        "ETCD_AUTH_CLIENT_CERT",
        "ETCD_AUTH_CLIENT_KEY",
        "ETCD_AUTH_SERVER_NAME",
        "NATS_TLS_KEY",
        "TLSKEY",
    }
)
_NAME_WORDS = re.compile(r"[A-Z0-9]+")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s]+)@")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable, option or key named `name` likely holds a secret."""
    upper = name.strip("-").upper().replace("-", "_")
    if upper.endswith(_NOT_SECRET_SUFFIXES) or upper in _NOT_SECRET_NAMES:
        return False
    return any(
        secret in word
        for word in _NAME_WORDS.findall(upper)
        if word not in _NOT_SECRET_WORDS
        for secret in _SECRET_WORDS
    )


def redact_url(text: str) -> str:
    """`scheme://user:password@host` (or a token as the user) -> `scheme://***@host`."""
    if "@" not in text:
        return text
    return _URL_USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", text)
