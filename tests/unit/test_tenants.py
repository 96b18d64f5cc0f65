"""The keys file (parsing, errors that name file, entry and field but never a key's hash,
reloads that keep the old tenants on error) and a tenant's limits on an injected clock."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from dynamo_graph.frontend.errors import HTTPError
from dynamo_graph.frontend.tenant_limits import Tenant, TenantState, TokenBucket
from dynamo_graph.frontend.tenants import KeysFileError, Tenants, add_entry, new_key, parse_keys

KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-9876543210"
SHA_A, SHA_B = (hashlib.sha256(k.encode()).hexdigest() for k in (KEY_A, KEY_B))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys_yaml(*entries: str) -> str:
    return "keys:\n" + "".join(entries)


def entry(name: str, sha: str, extra: str = "") -> str:
    return f"  - name: {name}\n    key_sha256: {sha}\n{extra}"


def test_a_full_entry_parses() -> None:
    text = keys_yaml(
        entry(
            "team-a",
            SHA_A.upper(),
            "    models: [llama, llama-sql-lora]\n    requests_per_minute: 600\n"
            "    tokens_per_minute: 200000\n    max_concurrent: 32\n    cache_group: shared-a\n",
        ),
        entry("team-b", SHA_B),
    )
    tenants = parse_keys("k.yaml", text)
    a = tenants[bytes.fromhex(SHA_A)]
    assert a == Tenant(
        "team-a",
        models=frozenset({"llama", "llama-sql-lora"}),
        requests_per_minute=600,
        tokens_per_minute=200000,
        max_concurrent=32,
        cache_group="shared-a",
    )
    b = tenants[bytes.fromhex(SHA_B)]
    assert b == Tenant("team-b") and b.allows("anything") and not a.allows("other")


def test_two_keys_of_one_tenant_must_agree() -> None:
    same = parse_keys("k.yaml", keys_yaml(entry("t", SHA_A), entry("t", SHA_B)))
    assert len(same) == 2 and len(set(same.values())) == 1
    with pytest.raises(KeysFileError, match=r"keys\[1\] \(t\): `max_concurrent` differs from keys\[0\]"):
        parse_keys("k.yaml", keys_yaml(entry("t", SHA_A), entry("t", SHA_B, "    max_concurrent: 2\n")))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: [", r"k.yaml: not valid YAML at line \d+, column \d+"),
        ("- a\n", r"k.yaml: must be a mapping with one key, `keys`"),
        ("keys: []\nextra: 1\n", r"k.yaml: must be a mapping with one key, `keys`"),
        (keys_yaml("  - just-a-string\n"), r"k.yaml:2: keys\[0\]: must be a mapping"),
        (
            keys_yaml(entry("a", SHA_A, "    model: [x]\n")),
            r"k.yaml:2: keys\[0\] \(a\): unknown field `model`",
        ),
        (keys_yaml(entry("bad name", SHA_A)), r"keys\[0\]: `name` must be"),
        (keys_yaml(entry("a", SHA_A[:-1])), r"keys\[0\] \(a\): `key_sha256` must be the 64 hex digits"),
        (keys_yaml(entry("a", SHA_A, "    models: llama\n")), r"keys\[0\] \(a\): `models` must be a list"),
        (keys_yaml(entry("a", SHA_A, "    max_concurrent: 0\n")), r"`max_concurrent` must be a whole number"),
        (keys_yaml(entry("a", SHA_A, "    tokens_per_minute: 1.5\n")), r"`tokens_per_minute` must be"),
        (keys_yaml(entry("a", SHA_A, "    requests_per_minute: true\n")), r"`requests_per_minute` must be"),
        (keys_yaml(entry("a", SHA_A, "    cache_group: ''\n")), r"`cache_group` must be"),
        (
            keys_yaml(entry("a", SHA_A), entry("b", SHA_A)),
            r"k.yaml:4: keys\[1\] \(b\): the same `key_sha256`",
        ),
    ],
)
def test_bad_files_name_the_entry_and_field_never_the_hash(text: str, message: str) -> None:
    with pytest.raises(KeysFileError, match=message) as info:
        parse_keys("k.yaml", text)
    assert SHA_A not in str(info.value) and SHA_A[:-1] not in str(info.value)


def test_reload_adds_keys_keeps_state_and_survives_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("team-a", SHA_A, "    max_concurrent: 1\n")))
    tenants = Tenants(str(path))
    a = tenants.find(KEY_A.encode())
    assert a is not None and tenants.find(KEY_B.encode()) is None and tenants.find(None) is None
    held = a.admit()  # in flight across the reloads
    assert not tenants.changed()
    path.write_text(keys_yaml(entry("team-a", SHA_A, "    max_concurrent: 2\n"), entry("team-b", SHA_B)))
    os.utime(path, ns=(1, 1))  # a change the mtime poll sees even within one clock tick
    assert tenants.changed() and tenants.reload()
    assert tenants.find(KEY_A.encode()) is a and a.inflight == 1 and a.tenant.max_concurrent == 2
    assert tenants.find(KEY_B.encode()) is not None
    path.write_text("keys: [")
    assert not tenants.reload() and tenants.reload_failures == 1
    assert tenants.find(KEY_B.encode()) is not None  # the old keys stay
    path.write_text(keys_yaml(entry("team-b", SHA_B)))
    assert tenants.reload() and tenants.find(KEY_A.encode()) is None
    held.release()
    assert a.inflight == 0 and a.removed and "team-a" in tenants.states  # its counters stay
    assert SHA_A not in repr(tenants)


def test_the_watch_reloads_a_changed_file_off_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("team-a", SHA_A)))
    tenants = Tenants(str(path))

    async def scenario() -> None:
        watch = asyncio.create_task(tenants.watch(poll_s=0.01))
        path.write_text(keys_yaml(entry("team-a", SHA_A), entry("team-b", SHA_B)))
        for _ in range(500):
            if tenants.find(KEY_B.encode()) is not None:
                break
            await asyncio.sleep(0.01)
        path.write_text(keys_yaml(entry("team-b", SHA_B)))
        tenants.reload_soon()  # SIGHUP's path
        for _ in range(500):
            if tenants.find(KEY_A.encode()) is None:
                break
            await asyncio.sleep(0.01)
        watch.cancel()

    asyncio.run(scenario())
    assert tenants.find(KEY_B.encode()) is not None and tenants.find(KEY_A.encode()) is None
    assert tenants.reloads >= 2


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="cannot read the keys file"):
        Tenants(str(tmp_path / "none.yaml"))


def test_a_new_entry_is_appended_only_when_the_file_stays_valid(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    key = new_key()
    add_entry(str(path), "team-a", key, ["llama", "odd: name"], "g")
    tenants = Tenants(str(path))
    state = tenants.find(key.encode())
    assert state is not None and state.tenant == Tenant(
        "team-a", frozenset({"llama", "odd: name"}), cache_group="g"
    )
    before = path.read_text()
    assert key not in before
    with pytest.raises(KeysFileError, match="the same `key_sha256`"):
        add_entry(str(path), "team-b", key)
    assert path.read_text() == before


@pytest.mark.parametrize(
    "text",
    [
        "keys: []  # none yet\n",
        "# tenants\nkeys:\n- name: a\n  models:\n  - x\n  key_sha256: " + SHA_A + "\n",
        "keys:\n    -   name: a\n        key_sha256: " + SHA_A + "  # first\n",
    ],
)
def test_an_entry_is_added_as_the_file_indents_its_entries(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    add_entry(str(path), "team-b", KEY_B)
    tenants = parse_keys("k", path.read_text())
    assert tenants[bytes.fromhex(SHA_B)] == Tenant("team-b")
    assert len(tenants) == (1 if "[]" in text else 2)
    assert path.read_text().startswith(text.split("[]")[0].rstrip())  # comments and entries kept


def test_a_flow_style_list_is_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys: [{{name: a, key_sha256: {SHA_A}}}]\n")
    with pytest.raises(KeysFileError, match="block list"):
        add_entry(str(path), "team-b", KEY_B)


def test_token_bucket_refills_and_may_be_overdrawn() -> None:
    clock = Clock()
    bucket = TokenBucket(60, clock)  # one a second, up to 60
    assert all(bucket.take() == 0.0 for _ in range(60))
    assert bucket.take() == pytest.approx(1.0)
    clock.now += 0.5
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.take() == 0.0
    bucket.charge(30)
    assert bucket.wait_s(0) == pytest.approx(30.0)
    clock.now += 1000
    assert bucket.wait_s(60) == 0.0 and bucket.take(61) > 0  # capped at a minute's worth


def _retry_after(err: HTTPError) -> int:
    return int(dict(err.headers or [])[b"retry-after"])


def test_requests_per_minute_429_with_retry_after() -> None:
    clock = Clock()
    state = TenantState(Tenant("t", requests_per_minute=2), clock)
    state.admit().release()
    state.admit().release()
    with pytest.raises(HTTPError) as info:
        state.admit()
    err = info.value
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.error_type == "requests"
    assert _retry_after(err) == 30 and "requests per minute" in err.message
    clock.now += 30
    state.admit().release()
    assert state.refused == {"requests_per_minute": 1} and state.finished == {"error": 3}


def test_tokens_per_minute_charges_prompt_then_completion() -> None:
    clock = Clock()
    state = TenantState(Tenant("t", tokens_per_minute=600), clock)  # 10 a second
    request = state.admit()
    request.prompt(500)
    request.prompt(500)  # charged once, however often the request is accepted
    state.admit().release()  # 100 left: still admitted
    request.ended("success", 500, 700)
    request.release()  # 100 - 700: 600 in debt
    with pytest.raises(HTTPError) as info:
        state.admit()
    assert info.value.error_type == "tokens" and _retry_after(info.value) == 60
    clock.now += 60
    state.admit()
    assert (state.prompt_tokens, state.completion_tokens) == (500, 700)
    assert state.finished == {"success": 1, "error": 1} and state.inflight == 1
    late = state.admit()  # an engine that counts the prompt itself: charged when it ends
    late.prompt(0)
    late.ended("success", 40, 2)
    late.release()
    assert (state.prompt_tokens, state.completion_tokens) == (540, 702)


def test_max_concurrent_and_reload_of_limits() -> None:
    clock = Clock()
    state = TenantState(Tenant("t", max_concurrent=1, requests_per_minute=60), clock)
    held = state.admit()
    with pytest.raises(HTTPError) as info:
        state.admit()
    assert info.value.status == 429 and _retry_after(info.value) == 1
    state.update(Tenant("t", max_concurrent=2, requests_per_minute=6))
    state.admit()
    assert state.inflight == 2 and state.requests is not None and state.requests.capacity == 6
    held.release()
    state.update(Tenant("t"))
    assert state.requests is None and state.tokens is None
