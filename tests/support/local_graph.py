"""A CI smoke graph (graphs/ci/) copied into a test's tmp_path, so that its state dir and every
log live there, run with `dyngraph up | status | down` on real processes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from openai import OpenAI

from tests.support.processes import free_port, run_cli

GRAPHS = Path(__file__).resolve().parents[2] / "graphs" / "ci"


class Graph:
    """A copied smoke graph with its frontend on a free port and the tiny model's absolute path."""

    def __init__(self, source: str, tmp_path: Path, tiny_model: Path) -> None:
        self.file = tmp_path / source
        shutil.copy(GRAPHS / source, self.file)
        self.port = free_port()
        self.overrides = [
            f"components.frontend.http.port={self.port}",
            f"models.tiny-model.path={tiny_model}",
        ]
        self.state = tmp_path / ".dyngraph" / self.file.stem

    @property
    def base_url(self) -> str:
        """The frontend's (as tests/support/routing.py reads a frontend's /health)."""
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return run_cli([args[0], str(self.file), *args[1:]], timeout=timeout)

    def up(self, *overrides: str) -> subprocess.CompletedProcess[str]:
        return self.cli("up", "-d", *self.overrides, *overrides)

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
