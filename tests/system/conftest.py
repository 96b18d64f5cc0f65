"""Fixtures shared by the system tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mocker_cluster import Cluster, start_cluster


@pytest.fixture
def make_cluster(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """`make(**kw)`: a started `start_cluster(tmp_path, tiny_model, **kw)`, stopped after the test
    (test_migration.py, test_chaos.py)."""
    made: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        cluster = start_cluster(tmp_path, tiny_model, **kw)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()
