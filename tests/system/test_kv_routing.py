"""KV-aware routing end to end: the real frontend with `--router-mode kv` and two mocker workers,
each its own process, over the embedded planes (file discovery, tcp, zmq events)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import opening_messages, routing_to, served_by

ENDPOINT = "dyn://kv.mocker.generate"


@pytest.fixture
def planes(tmp_path: Path) -> dict[str, str]:
    return embedded_planes_env(tmp_path, zmq_events=True)


@pytest.fixture
def kv_graph(
    tiny_model: Path, tmp_path: Path, planes: dict[str, str], request: pytest.FixtureRequest
) -> Iterator[tuple[ServerProcess, list[WorkerProcess]]]:
    """Two mocker workers (block size 16, fast simulated time) and a kv-routing frontend;
    `use_kv_events` comes from the test's parameter."""
    use_events: bool = request.param
    args = tmp_path / "mocker.json"
    args.write_text(json.dumps({"block_size": 16, "speedup_ratio": 50.0, "num_gpu_blocks": 4096}))
    argv = [*DYNGRAPH, "run", f"in={ENDPOINT}", "out=mocker", str(tiny_model), "--extra-engine-args"]
    workers = [WorkerProcess([*argv, str(args)], env=planes, log_dir=tmp_path) for _ in range(2)]
    frontend = ServerProcess(
        ["out=auto", "--router-mode", "kv", "--use-kv-events", "true" if use_events else "false"],
        env={**planes, "DYN_LOG": "info,dynamo_graph.router=debug"},
        log_dir=tmp_path,
    )
    with routing_to(frontend, workers, tiny_model.name):
        yield frontend, workers


@pytest.mark.serial  # times itself: run alone, not beside other test workers
@pytest.mark.parametrize("kv_graph", [True, False], ids=["kv-events", "approximate"], indirect=True)
def test_follow_up_turns_go_to_the_worker_holding_the_conversation(
    kv_graph: tuple[ServerProcess, list[WorkerProcess]], tiny_model: Path
) -> None:
    frontend, _ = kv_graph
    model = tiny_model.name
    http = httpx.Client(base_url=frontend.base_url, timeout=30)

    def chat(messages: list[dict]) -> dict:
        body = {"model": model, "messages": messages, "max_tokens": 24}
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    homes: dict[int, str] = {}
    for conv in range(6):
        messages = opening_messages(conv)
        home, first = served_by(frontend, model, lambda m=messages: chat(m))
        homes[conv] = home
        messages.append(first["choices"][0]["message"])
        for turn in range(2):
            messages.append({"role": "user", "content": f"Follow-up {turn}: can you check again?"})
            served, body = served_by(frontend, model, lambda m=messages: chat(m))
            assert served == home, f"conversation {conv} turn {turn + 2} left its worker"
            usage = body["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            # Everything up to the previous turn's answer is cached (whole 16-token blocks).
            assert cached >= first["usage"]["prompt_tokens"] - 16, usage
            messages.append(body["choices"][0]["message"])
    assert len(set(homes.values())) == 2, f"all conversations landed on one worker: {homes}"
