"""Changes without downtime: a git-versioned graph changed, broken, rolled back and scaled down
under continuous streamed load (official `openai` clients, keep-alive, no retries), with
`history` naming the commits. Every request must succeed: 0 failures is the acceptance."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.processes import free_port, run_cli
from tests.support.rolling_load import StreamingLoad


class VersionedGraph:
    """A mocker graph in its own git repository: each `commit` writes the graph and commits it."""

    def __init__(self, tmp_path: Path, tiny_model: Path) -> None:
        self.dir = tmp_path / "deploy"
        self.dir.mkdir()
        self.file = self.dir / "graph.yaml"
        self.port = free_port()
        self.graph = {
            "name": "rollout",
            "models": {"tiny-model": {"path": str(tiny_model)}},
            "components": {
                "frontend": {
                    "kind": "frontend",
                    "http": {"port": self.port},
                    "router": {"mode": "round-robin"},
                },
                "backend": {
                    "kind": "worker",
                    "model": "tiny-model",
                    "engine": "mocker",
                    "replicas": 2,
                    "engine_args": {"num_gpu_blocks": 1024, "speedup_ratio": 20.0},
                },
            },
        }
        self._git("init", "-q")
        self._git("config", "user.email", "ci@example.invalid")
        self._git("config", "user.name", "ci")

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.dir, check=True, capture_output=True, text=True).stdout

    @property
    def backend(self) -> dict:
        return self.graph["components"]["backend"]

    def commit(self, message: str) -> str:
        self.file.write_text(yaml.safe_dump(self.graph, sort_keys=False))
        self._git("add", "graph.yaml")
        self._git("commit", "-q", "-m", message)
        return self._git("rev-parse", "HEAD").strip()

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return run_cli([args[0], str(self.file), *args[1:]], timeout=timeout)

    def pids(self) -> dict[str, int]:
        status = json.loads(self.cli("status", "--json").stdout)
        return {p["name"]: p["pid"] for p in status["processes"] if not p["retiring"]}

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)


@pytest.fixture
def versioned(tmp_path: Path, tiny_model: Path) -> Iterator[VersionedGraph]:
    graph = VersionedGraph(tmp_path, tiny_model)
    try:
        yield graph
    finally:
        graph.cli("down", timeout=120)


@pytest.mark.serial  # times itself: run alone, not beside other test workers
def test_change_break_roll_back_and_scale_down_under_load_fail_nothing(versioned: VersionedGraph) -> None:
    graph = versioned
    first = graph.commit("two mocker replicas")
    assert graph.cli("up", "-d").returncode == 0
    with StreamingLoad(f"http://127.0.0.1:{graph.port}/v1", "tiny-model") as load:
        load.wait_for_requests(20)

        # (1) an engine-args change rolls both replicas, one at a time, new beside old
        before = graph.pids()
        graph.backend["engine_args"]["speedup_ratio"] = 25.0
        second = graph.commit("faster mocker")
        up = graph.cli("up", "-d")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "~ backend-0" in up.stdout and "~ backend-1" in up.stdout
        after = graph.pids()
        assert after["frontend-0"] == before["frontend-0"]
        assert after["backend-0"] != before["backend-0"] and after["backend-1"] != before["backend-1"]
        load.wait_for_requests(20)

        # (2) a revision whose engine cannot load is refused while the previous one serves
        graph.backend["engine_args"]["speedup_ratio"] = "not a number"
        graph.commit("broken engine args")
        broken = graph.cli("up", "-d")
        assert broken.returncode == 1, broken.stdout + broken.stderr
        assert "revision 3 failed" in broken.stdout and "backend-0 failed" in broken.stdout
        assert "speedup_ratio must be a number" in broken.stdout  # the failing process's log lines
        assert "rolled back" in broken.stdout
        assert graph.pids() == after
        status = graph.status()
        assert status["revision"]["number"] == 2 and status["rolling"] is None
        assert status["components"]["backend"] == {"desired": 2, "ready": 2, "revisions": [2]}
        load.wait_for_requests(20)

        # (3) rollback applies the revision before the serving one: the first
        back = graph.cli("rollback")
        assert back.returncode == 0, back.stdout + back.stderr
        assert "rolling back to revision 1" in back.stdout
        assert graph.status()["revision"]["number"] == 4
        load.wait_for_requests(20)

        # (4) scale up to 3, then down to 1: the removed replicas retire like replaced ones
        graph.backend["engine_args"]["speedup_ratio"] = 20.0
        graph.backend["replicas"] = 3
        graph.commit("three replicas")
        assert graph.cli("up", "-d").returncode == 0
        assert len([n for n in graph.pids() if n.startswith("backend-")]) == 3
        load.wait_for_requests(20)
        graph.backend["replicas"] = 1
        last = graph.commit("one replica")
        down = graph.cli("up", "-d")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "- backend-1" in down.stdout and "- backend-2" in down.stdout
        load.wait_for_requests(20)

        # (5) a frontend setting: the new frontend binds the same port beside the old one, which
        # finishes its streams and closes its kept-alive connections after their next answer
        before = graph.pids()
        graph.graph["components"]["frontend"]["limits"] = {"model_wait_s": 20.0}
        graph.commit("frontend waits longer for a model's workers")
        front = graph.cli("up", "-d")
        assert front.returncode == 0, front.stdout + front.stderr
        assert "~ frontend-0" in front.stdout and "backend" not in front.stdout.split("graph rollout")[0]
        after = graph.pids()
        assert after["frontend-0"] != before["frontend-0"] and after["backend-0"] == before["backend-0"]
        load.wait_for_requests(20)
    result = load.result
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"
    assert result.ok >= 100

    # (6) a change of the model's card (its tool-call parser): a frontend serves one card per
    # model and refuses the new replicas while an old one is left, so they take over together
    # once the old ones left; a request accepted for the old card in that instant is accepted
    # again by the new one.
    graph.backend["replicas"] = 2
    graph.graph["models"]["tiny-model"]["tool_call_parser"] = "hermes"
    graph.commit("hermes tool calls")
    with StreamingLoad(f"http://127.0.0.1:{graph.port}/v1", "tiny-model") as card_load:
        card_load.wait_for_requests(20)
        card = graph.cli("up", "-d")
        assert card.returncode == 0, card.stdout + card.stderr
        assert graph.status()["components"]["backend"] == {"desired": 2, "ready": 2, "revisions": [8]}
        card_load.wait_for_requests(20)
    handover = card_load.result
    assert handover.failures == [], f"{len(handover.failures)} of {handover.total}: {handover.failures[:5]}"

    history = graph.cli("history")
    assert history.returncode == 0, history.stdout + history.stderr
    for commit in (first, second, last):
        assert commit[:10] in history.stdout
    assert "rollback 1" in history.stdout and "failed" in history.stdout


def test_a_canary_promoted_then_one_with_a_slow_first_token_rolled_back_fail_nothing(
    versioned: VersionedGraph,
) -> None:
    """(6) `strategy: canary`: the new revision takes half the requests, is compared with the old
    one and promoted; a slower one (its first tokens 40x later) loses the comparison and is
    rolled back by itself, while the old revision serves on. No request fails in either."""
    graph = versioned
    graph.backend["rollout"] = {
        "strategy": "canary",
        "steps": [50, 100],
        "pause_s": 2,
        "min_requests": 5,
        "max_ttft_p90_ratio": 3,
    }
    graph.commit("canary rollouts")
    assert graph.cli("up", "-d").returncode == 0
    with StreamingLoad(f"http://127.0.0.1:{graph.port}/v1", "tiny-model") as load:
        load.wait_for_requests(20)
        before = graph.pids()
        graph.backend["engine_args"]["num_gpu_blocks"] = 2048
        graph.commit("more KV blocks")
        promoted = graph.cli("up", "-d")
        assert promoted.returncode == 0, promoted.stdout + promoted.stderr
        after = graph.pids()
        assert after["backend-0"] != before["backend-0"] and after["backend-1"] != before["backend-1"]
        assert graph.status()["components"]["backend"] == {"desired": 2, "ready": 2, "revisions": [2]}
        load.wait_for_requests(20)

        graph.backend["engine_args"]["speedup_ratio"] = 0.5
        graph.commit("a slow engine")
        slow = graph.cli("up", "-d")
        assert slow.returncode == 1, slow.stdout + slow.stderr
        assert "canary backend, step 1 of 2: 50% of requests" in slow.stdout, slow.stdout
        assert "TTFT p90" in slow.stdout and "rolled back" in slow.stdout
        assert graph.pids() == after
        status = graph.status()
        assert status["revision"]["number"] == 2 and status["rolling"] is None
        load.wait_for_requests(20)
    result = load.result
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"


def test_new_replicas_that_fail_the_graphs_checks_never_serve_and_are_rolled_back(
    versioned: VersionedGraph,
) -> None:
    """`rollout: {checks: true}`: the graph's own `tests` run against the first new replicas,
    through a frontend that routes to nothing else, while the graph's frontends send them no
    request; a revision whose first tokens miss the check's budget is rolled back, and the
    load never met it (no request fails, none waits on the slow replica)."""
    graph = versioned
    graph.backend["rollout"] = {"checks": True}
    graph.graph["tests"] = [
        {
            "name": "first token in time",
            "chat": {"prompt": "hi", "max_tokens": 4, "stream": True},
            "expect": {"ttft_s": 1.0},
        }
    ]
    graph.commit("checked rollouts")
    assert graph.cli("up", "-d").returncode == 0
    with StreamingLoad(f"http://127.0.0.1:{graph.port}/v1", "tiny-model") as load:
        load.wait_for_requests(20)
        graph.backend["engine_args"]["num_gpu_blocks"] = 2048
        graph.commit("more KV blocks")
        checked = graph.cli("up", "-d", timeout=300)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "checks against the new backend replicas passed" in checked.stdout, checked.stdout
        after = graph.pids()
        load.wait_for_requests(20)

        graph.backend["engine_args"]["speedup_ratio"] = 0.01
        graph.commit("a very slow engine")
        slow = graph.cli("up", "-d", timeout=300)
        assert slow.returncode == 1, slow.stdout + slow.stderr
        assert "the graph's checks failed against the new backend replicas" in slow.stdout, slow.stdout
        assert "first token in time" in slow.stdout and "rolled back" in slow.stdout
        assert graph.pids() == after
        load.wait_for_requests(20)
    result = load.result
    assert result.failures == [], f"{len(result.failures)} of {result.total} failed: {result.failures[:5]}"
    assert max(result.ttfts) < 1.0, "a request met the slow replica"
