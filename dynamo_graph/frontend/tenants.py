"""API keys with tenants: the keys file (`--api-keys-file`, a graph frontend's `auth.keys_file`).

```yaml
keys:
  - name: team-a                 # the tenant: metrics and logs name it
    key_sha256: 5e88...          # hex sha256 of the key; the key itself is never stored
    models: [llama, llama-sql-lora]   # models and adapters it may use; omitted = all
    requests_per_minute: 600     # optional limits (tenant_limits.py)
    tokens_per_minute: 200000
    max_concurrent: 32
    cache_group: shared-a        # optional: tenants of one group share cached prefixes
```

Entries with one name are one tenant with several keys (a key being rotated): they must agree on
everything but the key. A key is looked up by the sha256 of what the client presents, so the
time taken depends on that digest, never on how much of a stored key matched. Nothing here logs
or raises a key or a key's hash: errors name the file, the entry and the field.

`Tenants` holds the file's tenants and reloads them when the file changes (`watch`: an mtime
poll) or on SIGHUP (`reload`); a file that fails to load keeps the tenants it had. Each tenant's
limits and counters (`TenantState`) outlive reloads, so requests in flight finish under the
tenant they started under. The docs: docs/security.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

import msgspec
import yaml
from prometheus_client.core import CounterMetricFamily, Metric

from dynamo_graph.frontend.auth import protected_path
from dynamo_graph.frontend.tenant_limits import Tenant, TenantState, collect_tenants

log = logging.getLogger(__name__)

TENANT_SCOPE = "dyngraph.tenant"  # the ASGI scope key of an authenticated request's TenantState
RELOAD_POLL_S = 1.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML has it: ~7x faster
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_FIELDS = ("name", "key_sha256", "models", *_LIMITS, "cache_group")


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file, the entry and the field."""


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def _entry(where: str, raw: Any) -> tuple[bytes, Tenant]:
    """An entry's key digest and tenant; `where`: how errors name it (file, line, entry)."""
    if not isinstance(raw, dict):
        raise KeysFileError(f"{where}: must be a mapping with `name` and `key_sha256`")
    name = raw.get("name")
    if isinstance(name, str) and _NAME.match(name):
        where = f"{where} ({name})"
    unknown = sorted(str(k) for k in raw if k not in _FIELDS)
    if unknown:
        raise KeysFileError(f"{where}: unknown field `{unknown[0]}`; the fields are {', '.join(_FIELDS)}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise KeysFileError(
            f"{where}: `name` must be 1-64 letters, digits, `.`, `_` or `-`, starting with a letter or digit"
        )
    digest = raw.get("key_sha256")
    # Never echo the value: the hash of a key stays in the file.
    if not isinstance(digest, str) or not _HEX.match(digest.strip().lower()):
        raise KeysFileError(
            f"{where}: `key_sha256` must be the 64 hex digits of the key's sha256 "
            "(`dyngraph keys add NAME` makes a key and its entry)"
        )
    models = raw.get("models")
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)
    ):
        raise KeysFileError(f"{where}: `models` must be a list of model names (omit it for every model)")
    limits: dict[str, int] = {}
    for field in _LIMITS:
        value = raw.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KeysFileError(
                f"{where}: `{field}` must be a whole number of at least 1 (omit it for no limit)"
            )
        limits[field] = value
    group = raw.get("cache_group")
    if group is not None and (not isinstance(group, str) or not _NAME.match(group)):
        raise KeysFileError(
            f"{where}: `cache_group` must be 1-64 letters, digits, `.`, `_` or `-`, "
            "starting with a letter or digit"
        )
    tenant = Tenant(
        name=name, models=None if models is None else frozenset(models), cache_group=group, **limits
    )
    return bytes.fromhex(digest.strip().lower()), tenant


def _at(path: str, text: str, index: int) -> str:
    """`file:line: keys[index]`, the line where entry `index` starts."""
    keys = yaml.compose(text, Loader=_LOADER).value[0][1]
    return f"{path}:{keys.value[index].start_mark.line + 1}: keys[{index}]"


def parse_keys(path: str, text: str) -> dict[bytes, Tenant]:
    """The keys file's text -> {sha256 digest of a key: its tenant}; KeysFileError if invalid."""
    try:
        doc = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise KeysFileError(f"{path}: not valid YAML{at}: {problem}") from None
    if not isinstance(doc, dict) or set(doc) != {"keys"} or not isinstance(doc["keys"], list):
        raise KeysFileError(f"{path}: must be a mapping with one key, `keys`, a list of entries")
    tenants: dict[bytes, Tenant] = {}
    index_of: dict[bytes, int] = {}
    by_name: dict[str, tuple[int, Tenant]] = {}
    for index, raw in enumerate(doc["keys"]):
        try:
            digest, tenant = _entry(f"{path}: keys[{index}]", raw)
        except KeysFileError:  # again, named with its line (found only when needed)
            _entry(_at(path, text, index), raw)
            raise
        if digest in tenants:
            raise KeysFileError(
                f"{_at(path, text, index)} ({tenant.name}): the same `key_sha256` as keys[{index_of[digest]}]"
            )
        seen = by_name.get(tenant.name)
        if seen is not None and seen[1] != tenant:
            differs = next(
                f.name for f in fields(Tenant) if getattr(seen[1], f.name) != getattr(tenant, f.name)
            )
            raise KeysFileError(
                f"{_at(path, text, index)} ({tenant.name}): `{differs}` differs from keys[{seen[0]}] of "
                "the same name; the keys of one tenant share its models, limits and cache_group"
            )
        by_name.setdefault(tenant.name, (index, tenant))
        tenants[digest] = tenant
        index_of[digest] = index
    return tenants


def load_keys_file(path: str) -> dict[bytes, Tenant]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise KeysFileError(f"{path}: cannot read the keys file: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise KeysFileError(f"{path}: not UTF-8 text") from None
    return parse_keys(path, text)


def new_key() -> str:
    """A fresh random API key (256 bits)."""
    return "sk-dg-" + secrets.token_urlsafe(32)


def entry_yaml(
    name: str,
    key: str,
    models: list[str] | None = None,
    cache_group: str | None = None,
    indent: tuple[int, int] = (2, 4),
) -> str:
    """The keys file's entry of `key` for tenant `name`: a list item under `keys:` whose dash and
    fields are `indent` columns in. The key's hash, never the key."""
    dash, inner = indent
    fields = [f"name: {name}", f"key_sha256: {key_digest(key).hex()}"]
    if models:
        fields.append(f"models: {msgspec.json.encode(models).decode()}")  # JSON is YAML
    if cache_group:
        fields.append(f"cache_group: {cache_group}")
    first = " " * dash + "-" + " " * (inner - dash - 1) + fields[0]
    return "\n".join([first, *(" " * inner + f for f in fields[1:])]) + "\n"


def add_entry(
    path: str, name: str, key: str, models: list[str] | None = None, cache_group: str | None = None
) -> None:
    """Add `key`'s entry to the keys file (created if missing), indented as its other entries,
    comments kept, if the result is a valid keys file: otherwise KeysFileError and the file is
    left as it was. Written whole, then renamed, so a frontend never reads half a file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = "keys: []\n"
    parse_keys(path, text)  # the file as it is must be valid first
    keys = yaml.compose(text).value[0][1]
    if not keys.value:  # `keys: []` -> a block list
        before, after = text[: keys.start_mark.index].rstrip(" "), text[keys.end_mark.index :]
        text = before + "\n" + entry_yaml(name, key, models, cache_group) + after.removeprefix("\n")
    elif keys.flow_style:
        raise KeysFileError(f"{path}: write the `keys:` list as a block list (`- name: ...`) to add to it")
    else:
        indent = (keys.start_mark.column, keys.value[0].start_mark.column)
        text = text if text.endswith("\n") else text + "\n"
        text += entry_yaml(name, key, models, cache_group, indent)
    parse_keys(path, text)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def cache_salt(tenant: Tenant | None, request_salt: str | None) -> str | None:
    """The engine request's `cache_salt`: the tenant's group (its `cache_group`, else its name)
    and the request's own salt, encoded so that no request can spell another tenant's salt."""
    if tenant is None and request_salt is None:
        return None
    group = None if tenant is None else tenant.salt_group
    return msgspec.json.encode([group, request_salt]).decode()


def _try_load(path: str) -> dict[bytes, Tenant] | KeysFileError:
    try:
        return load_keys_file(path)
    except KeysFileError as err:
        return err


def _mtime(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class Tenants:
    """The keys file's tenants, by the digest of their keys, and their states by name."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        """Loads the file (KeysFileError when it cannot be used: a frontend must not come up open)."""
        self.path = path
        self.clock = clock
        self.states: dict[str, TenantState] = {}
        self._by_digest: dict[bytes, TenantState] = {}
        self._stamp = _mtime(path)
        self._install(load_keys_file(path))
        self.reloads = 0
        self.reload_failures = 0
        self._reloading: asyncio.Future[bool] | None = None

    def __repr__(self) -> str:  # never the keys' hashes
        return f"Tenants({self.path!r}, {len(self.states)} tenants)"

    def _install(self, tenants: dict[bytes, Tenant]) -> None:
        states: dict[str, TenantState] = {}
        for tenant in {t.name: t for t in tenants.values()}.values():  # one per tenant, not per key
            state = self.states.get(tenant.name)
            if state is None:
                state = TenantState(tenant, self.clock)
            else:
                state.update(tenant)
            states[tenant.name] = state
        # A removed tenant's state stays for its counters (and requests still in flight).
        for name, state in self.states.items():
            if name not in states:
                state.removed = True
                states[name] = state
        self.states = states
        self._by_digest = {digest: states[t.name] for digest, t in tenants.items()}

    def protects(self, path: str) -> bool:
        return protected_path(path)

    def find(self, token: bytes | None) -> TenantState | None:
        """The tenant whose key `token` is (the bearer token as sent), or None."""
        if not token:
            return None
        return self._by_digest.get(key_digest(token))

    def reload(self) -> bool:
        """Load the file again; on any error keep the current tenants and log why."""
        self._stamp = _mtime(self.path)
        return self._apply(_try_load(self.path))

    async def reload_async(self) -> bool:
        """`reload`, the file read and parsed in a thread: a large file (1000 tenants: ~40 ms,
        benchmarks/bench_tenant_auth.py) must not hold up the streams in flight."""
        self._stamp = _mtime(self.path)
        return self._apply(await asyncio.to_thread(_try_load, self.path))

    def reload_soon(self) -> None:
        """SIGHUP's handler: `reload_async` in a task of the running loop."""
        self._reloading = asyncio.ensure_future(self.reload_async())

    def _apply(self, loaded: dict[bytes, Tenant] | KeysFileError) -> bool:
        if isinstance(loaded, KeysFileError):
            self.reload_failures += 1
            log.error(
                "keys file not reloaded, keeping the %d keys loaded before: %s", len(self._by_digest), loaded
            )
            return False
        self._install(loaded)
        self.reloads += 1
        tenants = len({t.name for t in loaded.values()})
        log.info("keys file %s reloaded: %d keys of %d tenants", self.path, len(loaded), tenants)
        return True

    def changed(self) -> bool:
        return _mtime(self.path) != self._stamp

    async def watch(self, poll_s: float = RELOAD_POLL_S) -> None:
        """Reload whenever the file's mtime or size changes (runs until cancelled)."""
        while True:
            await asyncio.sleep(poll_s)
            if self.changed():
                await self.reload_async()

    def collect(self) -> Iterator[Metric]:
        yield from collect_tenants(self.states.values())
        reloads = CounterMetricFamily(
            "dynamo_frontend_keys_file_reloads",
            "Reloads of the keys file since the frontend started, by result (failed: the keys before stay)",
            labels=["result"],
        )
        reloads.add_metric(["ok"], self.reloads)
        reloads.add_metric(["failed"], self.reload_failures)
        yield reloads
