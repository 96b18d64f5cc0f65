"""Token-in/token-out and embeddings through a distributed graph: a kv-routing frontend, two
mocker workers generating and two mocker embedding workers, each its own process, over the
embedded planes (file discovery, tcp, zmq KV events)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import instances, requests_per_instance, served_by
from tests.support.waiting import wait_for

EMBED = "tiny-embed"


@pytest.fixture
def graph(tiny_model: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    planes = embedded_planes_env(tmp_path, zmq_events=True)
    args = tmp_path / "mocker.json"
    args.write_text(json.dumps({"block_size": 16, "speedup_ratio": 50.0, "embedding_dim": 32}))
    gen = [*DYNGRAPH, "run", "in=dyn://g.gen.generate", "out=mocker", str(tiny_model)]
    emb = [*DYNGRAPH, "run", "in=dyn://g.emb.generate", "out=mocker", str(tiny_model), "--embedding"]
    emb += ["--model-name", EMBED]
    workers = [
        WorkerProcess([*argv, "--extra-engine-args", str(args)], env=planes, log_dir=tmp_path)
        for argv in (gen, gen, emb, emb)
    ]
    frontend = ServerProcess(["out=auto", "--router-mode", "kv"], env=planes, log_dir=tmp_path)
    try:
        frontend.wait_ready(path="/live")
        wait_for(lambda: len(instances(frontend, tiny_model.name)) == 2, 30, "both generating workers")
        wait_for(lambda: len(instances(frontend, EMBED)) == 2, 30, "both embedding workers")
        yield frontend
    finally:
        frontend.stop()
        for worker in workers:
            worker.stop()


def test_tokens_are_kv_routed_and_embeddings_spread(graph: ServerProcess, tiny_model: Path) -> None:
    http = httpx.Client(base_url=graph.base_url, timeout=30)
    model = tiny_model.name
    models = {m["id"]: m["endpoints"] for m in http.get("/v1/models").json()["data"]}
    assert models[EMBED] == ["/v1/embeddings"]
    assert "/inference/v1/generate" in models[model]

    def tokens(prompt: list[int]) -> dict:
        body = {"model": model, "token_ids": prompt, "sampling_params": {"max_tokens": 4}}
        response = http.post("/inference/v1/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    # Follow-ups sharing a long prefix stay on the worker that cached it, as chat requests do.
    for conv in range(4):
        prefix = [100 + conv * 97 + i for i in range(64)]
        home, first = served_by(graph, model, lambda p=prefix: tokens(p))
        again, second = served_by(graph, model, lambda p=prefix: tokens([*p, 7, 8]))
        assert again == home
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        assert first["choices"][0]["token_ids"] == tokens(prefix)["choices"][0]["token_ids"]

    def embed(text: str) -> list[float]:
        response = http.post("/v1/embeddings", json={"model": EMBED, "input": [text, "other"]})
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    vectors = [embed("same text") for _ in range(4)]
    assert all(v == vectors[0] for v in vectors)  # deterministic on every worker
    assert all(n >= 2 for n in requests_per_instance(graph, EMBED).values())
    wrong = http.post(
        "/v1/chat/completions", json={"model": EMBED, "messages": [{"role": "user", "content": "x"}]}
    )
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


@pytest.mark.serial  # times itself: run alone, not beside other test workers
def test_an_embedding_request_whose_worker_dies_is_retried(tiny_model: Path, tmp_path: Path) -> None:
    """One slow embedding worker (its simulated prefill takes seconds) and one fast one; the
    worker killed mid-request leaves a stream broken before any answer, which the frontend's
    client sends to the other itself (runtime/client.py), before migration would."""
    planes = embedded_planes_env(tmp_path)
    argv = [*DYNGRAPH, "run", "in=dyn://r.emb.generate", "out=mocker", str(tiny_model), "--embedding"]
    workers = []
    for speedup in (0.01, 100.0):
        args = tmp_path / f"mocker-{speedup}.json"
        args.write_text(json.dumps({"speedup_ratio": speedup, "embedding_dim": 16}))
        workers.append(WorkerProcess([*argv, "--extra-engine-args", str(args)], env=planes, log_dir=tmp_path))
    frontend = ServerProcess(["out=auto", "--migration-limit", "1"], env=planes, log_dir=tmp_path)
    try:
        frontend.wait_ready(path="/live")
        wait_for(lambda: len(instances(frontend, tiny_model.name)) == 2, 30, "both embedding workers")
        body = {"model": tiny_model.name, "input": "word " * 100}
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(httpx.post, f"{frontend.base_url}/v1/embeddings", json=body, timeout=60)]
            answers.append(
                pool.submit(httpx.post, f"{frontend.base_url}/v1/embeddings", json=body, timeout=60)
            )
            # the fast worker has answered its request; the slow one is computing
            wait_for(lambda: sum(a.done() for a in answers) == 1, 30, "the fast worker's answer")
            workers[0].kill9()
            responses = [a.result() for a in answers]
        assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
        assert responses[0].json()["data"] == responses[1].json()["data"]
        metrics = httpx.get(f"{frontend.base_url}/metrics").text
        assert "dynamo_frontend_model_migration_total{" not in metrics, metrics  # no migration needed
    finally:
        frontend.stop()
        for worker in workers:
            worker.stop()
