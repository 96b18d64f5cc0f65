"""Units of embeddings and token-in/token-out: stop conditions on token ids, unit vectors, the
embedding card's checksum, the mocker's vectors, and a graph's `embedding: true` worker."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dynamo_graph.backend.embedding import unit_vector
from dynamo_graph.engines.mocker.embed import mean_pooled
from dynamo_graph.graph.build import build
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.protocol import StopConditions
from dynamo_graph.llm.token_output import TokenLimits
from tests.support.graph_problems import MINIMAL, problems


def test_token_limits_keep_the_stop_token_and_honour_min_tokens() -> None:
    limits = TokenLimits(
        StopConditions(max_tokens=10, stop_token_ids=[7], stop_token_ids_hidden=[2], min_tokens=2)
    )
    assert limits.cut([7, 5]) == ([7, 5], None, None)  # within min_tokens: ordinary tokens
    assert limits.cut([3, 2, 9]) == ([3, 2], "stop", None)  # eos: kept, not a requested stop id
    assert limits.count == 4
    asked = TokenLimits(StopConditions(stop_token_ids=[7], stop_token_ids_hidden=[2], ignore_eos=True))
    assert asked.cut([2, 2, 7, 1]) == ([2, 2, 7], "stop", 7)
    capped = TokenLimits(StopConditions(max_tokens=3))
    assert capped.cut([1, 2]) == ([1, 2], None, None)
    assert capped.cut([3, 4]) == ([3], "length", None)


def test_unit_vector_truncates_then_normalizes() -> None:
    assert unit_vector([3.0, 4.0, 12.0], 2) == [0.6, 0.8]
    assert unit_vector([0.0, 0.0]) == [0.0, 0.0]
    assert math.isclose(sum(v * v for v in unit_vector([1.0, 2.0, 3.0])), 1.0)


def test_mocker_vectors_are_deterministic_means() -> None:
    a, b = mean_pooled([5, 6], 8), mean_pooled([6, 5], 8)
    assert a == b and len(a) == 8
    assert mean_pooled([5], 8) != mean_pooled([6], 8)


def test_an_embedding_card_never_joins_a_generating_pool() -> None:
    chat = ModelDeploymentCard.without_files("m", model_input="tokens")
    embed = ModelDeploymentCard.without_files("m", model_input="tokens")
    embed.model_type = ["embedding"]
    assert chat.mdcsum() != embed.mdcsum()
    assert chat.mdcsum() == ModelDeploymentCard.without_files("m", model_input="tokens").mdcsum()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ("    embedding: true\n", "engine echo_core has no embedding mode"),
        ("    embedding: true\n    role: prefill\n", "has no prefill/decode split"),
    ],
)
def test_embedding_worker_checks(extra: str, fragment: str) -> None:
    graph = MINIMAL.replace("engine: echo_core", "engine: mocker") if "prefill" in extra else MINIMAL
    found = problems(graph + extra)
    assert [p.path for p in found] == ["components.backend.embedding"], found
    assert fragment in found[0].message


def test_embedding_worker_compiles_to_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "graph.yaml"
    path.write_text(MINIMAL.replace("engine: echo_core", "engine: llamacpp") + "    embedding: true\n")
    worker = next(p for p in build(path).plan.processes if p.component == "backend")
    assert "--embedding" in worker.argv
