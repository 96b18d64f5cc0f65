"""`out=llamacpp` as a distributed worker (`in=dyn://...`) behind an `out=auto` frontend, each its own
process over the embedded planes (file discovery, tcp request plane), with the openai client."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess
from tests.support.routing import instances
from tests.support.waiting import wait_for

if os.environ.get("CI"):
    import llama_cpp  # noqa: F401 - CI installs the llamacpp extra: a missing package must fail
else:
    pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")

ENDPOINT = "dyn://llama.backend.generate"


def test_llamacpp_worker_behind_a_frontend(tiny_model: Path, tmp_path: Path) -> None:
    planes = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(tmp_path / "kv"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_LEASE_TTL": "2",
    }
    args = tmp_path / "llamacpp.json"
    args.write_text(json.dumps({"n_parallel": 2, "n_threads": 1}))
    worker = WorkerProcess(
        [
            *DYNGRAPH,
            "run",
            f"in={ENDPOINT}",
            "out=llamacpp",
            str(tiny_model),
            "--extra-engine-args",
            str(args),
        ],
        env=planes,
        log_dir=tmp_path,
    )
    frontend = ServerProcess(["out=auto"], env=planes, log_dir=tmp_path)
    try:
        frontend.wait_ready(path="/live")
        wait_for(lambda: len(instances(frontend, tiny_model.name)) == 1, 30, "the llamacpp worker")
        base = f"{frontend.base_url}/v1"
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Where is my parcel?"}]
        full = client.chat.completions.create(
            model=tiny_model.name, messages=messages, max_tokens=16, temperature=0
        )
        assert full.choices[0].finish_reason == "length"
        assert full.usage is not None and full.usage.completion_tokens == 16
        text = ""
        stream = client.chat.completions.create(
            model=tiny_model.name,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == full.choices[0].message.content
        assert usage is not None and usage.prompt_tokens == full.usage.prompt_tokens
        # The worker's prefix reuse travels back as cached tokens.
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1

        async def many() -> list[str | None]:
            aclient = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
            replies = await asyncio.gather(
                *(
                    aclient.chat.completions.create(
                        model=tiny_model.name,
                        messages=[{"role": "user", "content": f"Question {i % 3}"}],
                        max_tokens=12,
                        temperature=0,
                    )
                    for i in range(9)
                )
            )
            await aclient.close()
            return [r.choices[0].message.content for r in replies]

        answers = asyncio.run(many())
        for i, answer in enumerate(answers):
            assert answer == answers[i % 3]  # greedy: the same question gets the same answer
    finally:
        frontend.stop()
        worker.stop()
    assert "Traceback" not in worker.log(), worker.log()
