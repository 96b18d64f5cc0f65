"""A CI smoke graph (graphs/ci/, or a graph file of the test's own) copied into a test's tmp_path,
so that its state dir and every log live there, run with `dyngraph up | status | down` on real
processes; and traffic to it from a thread."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml
from openai import OpenAI

from tests.support.processes import free_port, run_cli

GRAPHS = Path(__file__).resolve().parents[2] / "graphs" / "ci"


class Graph:
    """A copied graph with its frontend on a free port and the tiny model's absolute path (as
    model `model`)."""

    def __init__(
        self, source: str | Path, tmp_path: Path, tiny_model: Path, model: str = "tiny-model"
    ) -> None:
        origin = GRAPHS / source  # an absolute path stays itself
        self.file = tmp_path / origin.name
        shutil.copy(origin, self.file)
        self.port = free_port()
        self.overrides = [
            f"components.frontend.http.port={self.port}",
            f"models.{model}.path={tiny_model}",
        ]
        self.state = tmp_path / ".dyngraph" / self.file.stem

    @property
    def base_url(self) -> str:
        """The frontend's (as tests/support/routing.py reads a frontend's /health)."""
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return run_cli([args[0], str(self.file), *args[1:]], timeout=timeout)

    def up(self, *overrides: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.cli("up", "-d", *self.overrides, *overrides, timeout=timeout)

    def processes(self) -> dict[str, dict]:
        records = json.loads((self.state / "processes.json").read_text())
        return {r["name"]: r for r in records}

    def ports(self) -> list[int]:
        ports_file = self.state / "ports.json"
        auto = list(json.loads(ports_file.read_text()).values()) if ports_file.exists() else []
        return [self.port, *auto]

    def chat(self) -> str:
        url = f"http://127.0.0.1:{self.port}/v1"
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=10)
        reply = client.chat.completions.create(
            model="tiny-model",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=4,
            extra_body={"nvext": {"ignore_eos": True}},
        )
        return reply.choices[0].message.content or ""


@contextmanager
def running(text: str, folder: Path, tiny_model: Path, *, timeout: float = 60.0) -> Iterator[Graph]:
    """A graph the test writes (YAML `text`, its model `tiny-model`), up in `folder` for the
    with-block (`up` within `timeout` seconds), then down."""
    source = folder / "source" / f"{yaml.safe_load(text)['name']}.yaml"
    source.parent.mkdir()
    source.write_text(text)
    graph = Graph(source, folder, tiny_model)
    try:
        up = graph.up(timeout=timeout)
        assert up.returncode == 0, up.stdout + up.stderr
        yield graph
    finally:
        graph.cli("down", timeout=120)


class Traffic:
    """Streamed chat requests to the graph's frontend one after another from a thread, until
    stopped (at most 60 s)."""

    def __init__(self, graph: Graph, model: str = "tiny-model") -> None:
        self.client = OpenAI(base_url=f"{graph.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        self.model = model
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while not self.stop.is_set() and time.monotonic() < deadline:
            stream = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "hello"}], max_tokens=32, stream=True
            )
            for _ in stream:
                pass
            self.sent += 1

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(30)
