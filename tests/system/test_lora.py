"""LoRA adapters end to end: a real frontend and two mocker workers, each its own process, over
the embedded planes. An adapter loaded at run time on one worker is listed (with its base model
as `parent`), served only by that worker, answers differently from the base model, and is gone
(404) once unloaded; adapters declared on a worker's command line come up with it; with kv
routing, an adapter's requests go to the worker holding their cached prefix."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from dynamo_graph.dev.tiny_lora import build_tiny_lora
from tests.support.metrics import router_metric
from tests.support.mocker_cluster import Cluster
from tests.support.processes import running_server
from tests.support.routing import instances, served_by
from tests.support.waiting import wait_for

ADAPTER = "tiny-sql"
PROMPT = "SELECT the answer FROM"
KEY = "sk-lora-test"
# A document several KV blocks long (16-token blocks), asked several questions.
DOCUMENT = (
    "Shipping policy, section 4: parcels leave the depot within two working days; tracking numbers "
    "are issued at the depot; delivery dates are promised only once the carrier confirms them."
)


@pytest.fixture(scope="module")
def tiny_lora(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lora(tmp_path_factory.mktemp("tiny-lora"), tiny_model)


def _post(cluster: Cluster, route: str, body: dict, **kw: object) -> httpx.Response:
    return httpx.post(f"{cluster.frontend.base_url}/v1/{route}", json=body, timeout=30, **kw)  # type: ignore[arg-type]


def _complete(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return answer.choices[0].text


def _models(cluster: Cluster, **kw: object) -> dict[str, dict]:
    data = httpx.get(f"{cluster.frontend.base_url}/v1/models", timeout=10, **kw).json()["data"]  # type: ignore[arg-type]
    return {m["id"]: m for m in data}


@pytest.mark.parametrize("router", ["round-robin", "kv"])
def test_adapter_loaded_at_run_time_is_served_only_where_loaded(
    make_cluster, tiny_lora: Path, router: str
) -> None:
    cluster = make_cluster(workers=2, limit=None, speedup=20.0, router=router)
    one, other = cluster.routable()
    client = openai.OpenAI(base_url=f"{cluster.frontend.base_url}/v1", api_key="unused", max_retries=0)
    base_text = _complete(client, cluster.model)

    answer = _post(
        cluster,
        "load_lora_adapter",
        {"lora_name": ADAPTER, "lora_path": str(tiny_lora), "instance_ids": [one]},
    )
    assert answer.status_code == 200, answer.text
    assert answer.text == f"Success: LoRA adapter '{ADAPTER}' added successfully."
    models = _models(cluster)
    assert models[ADAPTER]["parent"] == cluster.model and models[cluster.model]["parent"] is None

    for _ in range(6):
        instance, text = served_by(cluster.frontend, ADAPTER, lambda: _complete(client, ADAPTER))  # type: ignore[arg-type, return-value]
        assert instance == one
    assert text != base_text  # the adapter changes greedy output, the same on every request
    assert _complete(client, ADAPTER) == text
    assert _complete(client, cluster.model) == base_text  # the base model is untouched

    again = _post(
        cluster, "load_lora_adapter", {"lora_name": ADAPTER, "lora_path": "/elsewhere", "instance_ids": [one]}
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"

    gone = _post(cluster, "unload_lora_adapter", {"lora_name": ADAPTER})
    assert gone.status_code == 200, gone.text
    assert ADAPTER not in _models(cluster)
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, ADAPTER)
    assert err.value.status_code == 404 and err.value.body["param"] == "model"  # type: ignore[index]
    assert other in cluster.routable() and _complete(client, cluster.model) == base_text


def test_unknown_adapters_and_bad_loads_are_named(make_cluster, tiny_lora: Path, tmp_path: Path) -> None:
    """Behind the frontend's API key, like every /v1/ route; every mistake a 4xx naming its field."""
    cluster = make_cluster(workers=1, limit=None, speedup=20.0, frontend_env={"DYN_API_KEY": KEY})
    client = openai.OpenAI(base_url=f"{cluster.frontend.base_url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model"  # type: ignore[index]

    body = {"lora_name": "x", "lora_path": str(tiny_lora)}
    assert _post(cluster, "load_lora_adapter", body).status_code == 401
    assert _post(cluster, "unload_lora_adapter", {"lora_name": "x"}).status_code == 401
    auth = {"headers": {"Authorization": f"Bearer {KEY}"}}
    cases = [
        ("unload_lora_adapter", {"lora_name": "no-such-adapter"}, 404, "lora_name"),
        ("load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "lora_path"),
        ("load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("load_lora_adapter", {"lora_name": cluster.model, "lora_path": str(tiny_lora)}, 400, "lora_name"),
        ("load_lora_adapter", {**body, "base_model": "nope"}, 404, "base_model"),
        ("load_lora_adapter", {**body, "instance_ids": ["abc"]}, 400, "instance_ids"),
        ("load_lora_adapter", {**body, "instance_ids": ["not hex"]}, 400, "instance_ids"),
        ("load_lora_adapter", {**body, "bogus": 1}, 400, "bogus"),
    ]
    for route, sent, status, param in cases:
        answer = _post(cluster, route, sent, **auth)
        assert answer.status_code == status, (sent, answer.text)
        assert answer.json()["error"]["param"] == param, (sent, answer.text)
    assert list(_models(cluster, **auth)) == [cluster.model]  # nothing half-loaded
    assert _post(cluster, "load_lora_adapter", body, **auth).status_code == 200
    assert set(_models(cluster, **auth)) == {cluster.model, "x"}


def test_adapters_declared_on_the_command_line_come_up_with_the_worker(make_cluster, tiny_lora: Path) -> None:
    # A model whose workers left stays for --model-wait-s: 1 s here, not 30.
    cluster = make_cluster(workers=0, limit=None, speedup=20.0, frontend_args=["--model-wait-s", "1"])
    cluster.start_worker(extra_args=["--lora-modules", f"{ADAPTER}={tiny_lora},second={tiny_lora}"])
    wait_for(lambda: {ADAPTER, "second"} <= set(_models(cluster)), 60, "the declared adapters")
    client = openai.OpenAI(base_url=f"{cluster.frontend.base_url}/v1", api_key="unused", max_retries=0)
    texts = {_complete(client, name) for name in (cluster.model, ADAPTER, "second")}
    assert len(texts) == 3  # each adapter its own output
    cluster.workers[0].stop()
    wait_for(lambda: not _models(cluster), 30, "the models to leave with their worker")


def test_in_process_serving_has_the_same_routes(tiny_model: Path, tiny_lora: Path, tmp_path: Path) -> None:
    """`dyngraph run in=http out=mocker`, as vLLM's own server: adapters of --lora-modules and
    of the routes are models of the one process."""
    args = ["out=mocker", "--model-path", str(tiny_model), "--lora-modules", f"declared={tiny_lora}"]
    with running_server(args, log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        data = {m.id: m for m in client.models.list().data}
        assert set(data) == {tiny_model.name, "declared"}
        assert data["declared"].model_extra["parent"] == tiny_model.name  # type: ignore[index]
        url = f"{server.base_url}/v1"
        body = {"lora_name": "runtime", "lora_path": str(tiny_lora)}
        assert httpx.post(f"{url}/load_lora_adapter", json=body, timeout=30).status_code == 200
        texts = {_complete(client, name) for name in (tiny_model.name, "declared", "runtime")}
        assert len(texts) == 3
        wrong = httpx.post(f"{url}/load_lora_adapter", json={**body, "instance_ids": ["1"]}, timeout=30)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "instance_ids"
        assert (
            httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "runtime"}, timeout=30).status_code
            == 200
        )
        missing = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "runtime"}, timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
        with pytest.raises(openai.NotFoundError):
            _complete(client, "runtime")


def test_adapter_requests_are_kv_routed_to_the_worker_holding_their_prefix(
    make_cluster, tiny_lora: Path
) -> None:
    """Two mocker workers, the adapter loaded on both at run time: each document's follow-up
    questions through the adapter go to the worker that cached the document for the adapter, as
    the adapter's own KV router (fed by events naming the adapter) finds it; the same prompts for
    the base model find nothing of the adapter's cached, nor does the base model's router."""
    # Dynamo's cost spreads new prefixes over idle workers (the smallest cache wins a tie), so
    # both workers hold documents; the adapter's router works alike under either cost.
    cluster = make_cluster(
        workers=2, limit=None, speedup=20.0, router="kv", frontend_args=["--router-cost", "dynamo"]
    )
    loaded = _post(cluster, "load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(tiny_lora)})
    assert loaded.status_code == 200, loaded.text
    wait_for(lambda: len(instances(cluster.frontend, ADAPTER)) == 2, 30, "the adapter on both workers")
    client = openai.OpenAI(base_url=f"{cluster.frontend.base_url}/v1", api_key="unused", max_retries=0)
    documents = [f"Document {d}: {DOCUMENT} Reference number {d * 7919}." for d in range(4)]

    def ask(model: str, prompt: str) -> dict:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        return answer.model_dump()

    def cached(body: dict) -> int:
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def adapter_blocks() -> float:
        return router_metric(cluster.frontend, "indexed_blocks", ADAPTER)

    homes = set()
    for document in documents:
        indexed = adapter_blocks()
        home, first = served_by(
            cluster.frontend, ADAPTER, lambda d=document: ask(ADAPTER, f"{d} Question 0?")
        )
        assert cached(first) == 0
        homes.add(home)
        # The adapter's router has heard the worker's stored events for the document's blocks.
        wait_for(lambda i=indexed: adapter_blocks() > i, 10, "adapter KV events")
        for question in range(1, 3):
            served, body = served_by(
                cluster.frontend, ADAPTER, lambda d=document, q=question: ask(ADAPTER, f"{d} Question {q}?")
            )
            assert served == home, f"a follow-up on {document[:12]!r} left the worker holding it"
            assert cached(body) >= first["usage"]["prompt_tokens"] - 32, body["usage"]
    assert len(homes) == 2, "every document landed on one worker"
    assert router_metric(cluster.frontend, "routed_overlap_blocks_total", ADAPTER) >= 8 * len(documents)
    # The base model's router never indexed the adapter's blocks, and the same prompts for the
    # base model are computed afresh wherever they go.
    assert router_metric(cluster.frontend, "indexed_blocks", cluster.model) == 0
    for document in documents:
        assert cached(ask(cluster.model, f"{document} Question 1?")) == 0
    assert router_metric(cluster.frontend, "routed_overlap_blocks_total", cluster.model) == 0
