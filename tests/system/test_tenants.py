"""API keys with tenants end to end: the real frontend (`--api-keys-file`, kv routing) and a
mocker worker, each its own process, with the official openai client: 401, the 404 of a model
a key may not use, 429 with Retry-After, per-tenant metrics, a reload that adds a key while a
stream is in flight, cache isolation between tenants (and sharing inside a cache group), and no
key or key hash in the logs, argv or /metrics."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env, run_cli
from tests.support.routing import routing_to
from tests.support.waiting import wait_for

ENDPOINT = "dyn://tenants.mocker.generate"
KEYS = {
    name: f"sk-{name}-{i:02d}-5e8848"
    for i, name in enumerate(("a", "b", "c", "d", "limited", "narrow", "new"))
}
# A long prompt: many full blocks of 16 tokens.
PROMPT = "Tenants must never share a cached prefix unless their keys file says so. " * 8


def sha(name: str) -> str:
    return hashlib.sha256(KEYS[name].encode()).hexdigest()


def entry(name: str, **extra: object) -> dict[str, object]:
    return {"name": f"team-{name}", "key_sha256": sha(name), **extra}


ENTRIES = [
    entry("a"),
    entry("b"),
    entry("c", cache_group="shared"),
    entry("d", cache_group="shared"),
    entry("limited", requests_per_minute=2),
    entry("narrow", models=["some-other-model"]),
]


def write_keys(path: Path, entries: list[dict[str, object]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"keys": entries}, default_flow_style=False, sort_keys=False))
    tmp.replace(path)


@pytest.fixture(scope="module")
def graph(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("tenants")
    planes = embedded_planes_env(tmp, zmq_events=True)
    keys = tmp / "keys.yaml"
    write_keys(keys, ENTRIES)
    args = tmp / "mocker.json"
    args.write_text(json.dumps({"block_size": 16, "speedup_ratio": 0.5, "num_gpu_blocks": 4096}))
    worker = WorkerProcess(
        [*DYNGRAPH, "run", f"in={ENDPOINT}", "out=mocker", str(tiny_model), "--extra-engine-args", str(args)],
        env=planes,
        log_dir=tmp,
    )
    frontend = ServerProcess(
        ["out=auto", "--router-mode", "kv", "--api-keys-file", str(keys)],
        env={**planes, "DYN_LOG": "debug"},  # the most verbose logging: still no keys
        log_dir=tmp,
    )
    with routing_to(frontend, [worker], tiny_model.name):
        yield frontend, keys


def client(frontend: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key=key, max_retries=0, timeout=30)


def cached(frontend: ServerProcess, name: str, model: str) -> int:
    out = client(frontend, KEYS[name]).chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2
    )
    assert out.usage is not None and out.usage.prompt_tokens > 64
    details = out.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    return details.cached_tokens


def metrics(frontend: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{frontend.base_url}/metrics").text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("dynamo_frontend_tenant_", "dynamo_frontend_keys_file_"))
    }


def inflight(frontend: ServerProcess, tenant: str) -> float:
    return metrics(frontend)[f'dynamo_frontend_tenant_inflight_requests{{tenant="{tenant}"}}']


def test_a_missing_or_unknown_key_is_401(graph: tuple[ServerProcess, Path], tiny_model: Path) -> None:
    frontend, _ = graph
    with pytest.raises(openai.AuthenticationError) as info:
        client(frontend, "sk-nobody").models.list()
    assert info.value.status_code == 401
    resp = httpx.post(f"{frontend.base_url}/v1/chat/completions", json={"model": tiny_model.name})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_a_model_the_key_may_not_use_is_404_as_a_missing_one(
    graph: tuple[ServerProcess, Path], tiny_model: Path
) -> None:
    frontend, _ = graph
    narrow = client(frontend, KEYS["narrow"])
    assert [m.id for m in narrow.models.list()] == []  # it sees only its own models
    with pytest.raises(openai.NotFoundError) as forbidden:
        narrow.chat.completions.create(model=tiny_model.name, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError) as missing:
        client(frontend, KEYS["a"]).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    load = httpx.post(
        f"{frontend.base_url}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/nowhere"},
        headers={"Authorization": f"Bearer {KEYS['a']}"},
    )
    assert load.status_code == 403 and load.json()["error"]["code"] == "permission_denied"
    bodies = [err.value.body for err in (forbidden, missing)]
    assert all(b["code"] == "model_not_found" and b["param"] == "model" for b in bodies)  # type: ignore[index]
    assert forbidden.value.message.replace(tiny_model.name, "M") == missing.value.message.replace(
        "no-such-model", "M"
    )


def test_past_requests_per_minute_is_429_with_retry_after(
    graph: tuple[ServerProcess, Path], tiny_model: Path
) -> None:
    frontend, _ = graph
    limited = client(frontend, KEYS["limited"])
    for _ in range(2):
        limited.completions.create(model=tiny_model.name, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        limited.completions.create(model=tiny_model.name, prompt="hi", max_tokens=1)
    err = info.value
    assert err.status_code == 429 and 1 <= int(err.response.headers["retry-after"]) <= 30
    assert err.body["code"] == "rate_limit_exceeded" and err.body["type"] == "requests"  # type: ignore[index]


def test_cache_isolation_between_tenants_and_sharing_in_a_group(
    graph: tuple[ServerProcess, Path], tiny_model: Path
) -> None:
    frontend, _ = graph
    model = tiny_model.name
    assert cached(frontend, "a", model) == 0
    assert cached(frontend, "b", model) == 0  # the identical prompt: none of team-a's blocks
    assert cached(frontend, "a", model) > 64  # team-a's repeat hits its own
    assert cached(frontend, "c", model) == 0
    assert cached(frontend, "d", model) > 64  # one cache group: team-d hits team-c's prefix
    # A request's own cache_salt is honoured within the tenant.
    salted = client(frontend, KEYS["a"]).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_body={"cache_salt": "per-user-1"},
    )
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_a_reload_adds_a_key_while_a_stream_goes_on(
    graph: tuple[ServerProcess, Path], tiny_model: Path
) -> None:
    frontend, keys = graph
    staged = keys.with_name("staged.yaml")  # the new file, made before the stream starts
    staged.write_text(keys.read_text())
    added = run_cli(["keys", "add", "team-new", "--file", str(staged), "--model", tiny_model.name])
    assert added.returncode == 0, added.stderr
    newcomer = client(frontend, added.stdout.strip())
    stream = client(frontend, KEYS["a"]).completions.create(
        model=tiny_model.name, prompt="stream on", max_tokens=400, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # in flight
    staged.replace(keys)  # the mtime poll picks it up

    def admitted() -> bool:
        try:
            return [m.id for m in newcomer.models.list()] == [tiny_model.name]
        except openai.AuthenticationError:
            return False

    wait_for(admitted, 10, "the new key after the keys file changed")
    keys.write_text("keys: [")  # a bad file: the keys loaded before stay
    os.kill(frontend.proc.pid, signal.SIGHUP)
    wait_for(lambda: "keys file not reloaded" in frontend.log(), 10, "the failed reload's log line")
    assert admitted()
    assert inflight(frontend, "team-a") == 1  # the stream is still being generated
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"  # the stream finished through both reloads
    write_keys(keys, ENTRIES)
    os.kill(frontend.proc.pid, signal.SIGHUP)
    wait_for(lambda: not admitted(), 10, "the key removed again on SIGHUP")


def test_per_tenant_metrics_and_no_secret_anywhere(
    graph: tuple[ServerProcess, Path], tiny_model: Path
) -> None:
    frontend, _ = graph
    client(frontend, KEYS["b"]).completions.create(model=tiny_model.name, prompt="count me", max_tokens=3)
    samples = metrics(frontend)
    text = httpx.get(f"{frontend.base_url}/metrics").text
    assert samples['dynamo_frontend_tenant_requests_total{status="success",tenant="team-b"}'] >= 1
    assert samples['dynamo_frontend_tenant_tokens_total{kind="completion",tenant="team-b"}'] >= 3
    assert samples['dynamo_frontend_tenant_tokens_total{kind="prompt",tenant="team-b"}'] > 0
    assert samples['dynamo_frontend_tenant_errors_total{reason="model_not_found",tenant="team-narrow"}'] >= 1
    assert samples['dynamo_frontend_keys_file_reloads_total{result="failed"}'] >= 1
    time.sleep(0.2)  # the log is written by another process
    cmdline = Path(f"/proc/{frontend.proc.pid}/cmdline").read_bytes().decode()
    for where, content in (("log", frontend.log()), ("/metrics", text), ("argv", cmdline)):
        for name in KEYS:
            assert KEYS[name] not in content, (where, name)
            assert sha(name) not in content, (where, name)
