"""What the frontend's router reads stays at the frontend: a worker receives the session and the
priority of a request (engines schedule by the priority) but not the prompt's cached-segment
prefixes, which only the router's block hashing uses. Real frontend (kv routing) and a real
`pytok` worker process that records the routing hints it was sent."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import openai

from dynamo_graph.llm.chat_template import ChatTemplate
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.llm.segment_tokenizer import SegmentTokenizer
from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import instances
from tests.support.waiting import wait_for

ENGINE = """
import json

async def generate(request):
    with open({record!r}, "a") as out:
        out.write(json.dumps(request.get("routing")) + "\\n")
    yield {{"token_ids": [100], "finish_reason": "length"}}
"""
DOCUMENT = "Answer from this document.\n\n" + "serving router prefix cache " * 200


def test_workers_get_session_and_priority_but_not_the_routers_prefixes(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = resolve_model(str(tiny_model))
    template = ChatTemplate(model.chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
    chat = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Which word comes first?"}]
    _, prefixes = SegmentTokenizer(model.load_tokenizer()).encode_prefixed(
        template.render(chat, add_generation_prompt=True)
    )
    assert prefixes, "the frontend names cached prefixes for this chat"

    record = tmp_path / "routing.jsonl"
    engine = tmp_path / "recording_engine.py"
    engine.write_text(textwrap.dedent(ENGINE.format(record=str(record))))
    env = embedded_planes_env(tmp_path, zmq_events=True)
    argv = [*DYNGRAPH, "run", "in=dyn://hints.pytok.generate", f"out=pytok:{engine}", str(tiny_model)]
    argv += ["--context-length", "4096"]
    worker = WorkerProcess(argv, env=env, log_dir=tmp_path)
    frontend = ServerProcess(["out=auto", "--router-mode", "kv"], env=env, log_dir=tmp_path)
    try:
        frontend.wait_ready(path="/live")
        wait_for(lambda: len(instances(frontend, tiny_model.name)) == 1, 30, "the worker")
        api = openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # the second time, the segments' ids and block hashes are cached
            api.chat.completions.create(
                model=tiny_model.name,
                messages=chat,  # type: ignore[arg-type]
                max_tokens=1,
                extra_headers={"x-session-id": "s-1", "x-dynamo-request-priority": "3"},
            )
        sent = [json.loads(line) for line in record.read_text().splitlines()]
        assert len(sent) == 2
        for hints in sent:  # (the worker's dict of the request has every field, None if unset)
            assert (hints["session_id"], hints["priority"], hints.get("prefixes")) == ("s-1", 3, None)
    finally:
        frontend.stop()
        worker.stop()
