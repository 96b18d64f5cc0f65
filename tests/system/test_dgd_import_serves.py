"""A Dynamo deployment from a cluster repo as a smoke graph on a laptop: `dyngraph import` of
each of Dynamo's example deployments, the workers swapped for the mocker (their engine args
dropped) and the model for the tiny one by overrides, served for real (`up -d`, the openai
client, `down`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from tests.procs import free_port, run_cli

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "dynamo" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_imported_dgd_serves_on_the_mocker(example: Path, tmp_path: Path, tiny_model: Path) -> None:
    graph_file = tmp_path / example.name
    imported = run_cli(["import", str(example), "-o", str(graph_file)])
    assert imported.returncode == 0, imported.stderr
    graph = yaml.safe_load(graph_file.read_text())
    assert graph["components"]["Frontend"]["depends_on"]  # its decode or aggregated workers
    port = free_port()
    overrides = [f"components.Frontend.http.port={port}"]
    overrides += [f"models.{key}.path={tiny_model}" for key in graph["models"]]
    workers = [k for k, c in graph["components"].items() if c["kind"] == "worker"]
    overrides += [f"components.{k}.engine=mocker" for k in workers]
    overrides += [f"~components.{k}.engine_args" for k in workers if "engine_args" in graph["components"][k]]
    try:
        up = run_cli(["up", "-d", str(graph_file), *overrides], timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=20)
        (model,) = [m.id for m in client.models.list().data]
        assert model == "Qwen/Qwen3-0.6B"  # the name Dynamo would serve it under
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=4,
            extra_body={"nvext": {"ignore_eos": True}},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
    finally:
        down = run_cli(["down", str(graph_file)], timeout=90)
    assert down.returncode == 0, down.stdout + down.stderr
