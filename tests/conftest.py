"""Shared fixtures. The tiny model is real (tokenizer, safetensors, GGUF) and built once per session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from dynamo_graph.dev.tiny_model import ensure_tiny_model
from tests.support.services import EtcdProc, NatsProc, start_etcd, start_nats

T = TypeVar("T")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-model folder (HF files + tiny-llama-f32.gguf). Set DYNGRAPH_TINY_MODEL=DIR to build
    it once into DIR and reuse it across sessions (absolute: graphs in other folders name it)."""
    reuse = os.environ.get("DYNGRAPH_TINY_MODEL")
    out = Path(reuse).resolve() if reuse else tmp_path_factory.mktemp("tiny-model")
    return ensure_tiny_model(out)


# ---- services: etcd and nats-server (tests/support/services.py) -------------------------------------


def _service_or_skip(start: Callable[[], T], binary: str) -> T:
    """Skip when the binary is missing, except under CI, which installs it and must fail loudly."""
    try:
        return start()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{binary} not installed ({exc})")


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProc]:
    """One etcd for the session; tests that stop or restart etcd use `etcd_fresh`."""
    proc = _service_or_skip(lambda: start_etcd(tmp_path_factory.mktemp("etcd")), "etcd")
    yield proc
    proc.stop()


@pytest.fixture
def etcd_fresh(tmp_path: Path) -> Iterator[EtcdProc]:
    """A private etcd (about 0.1 s to start) that the test may stop, restart or kill."""
    proc = _service_or_skip(lambda: start_etcd(tmp_path), "etcd")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsProc]:
    proc = _service_or_skip(lambda: start_nats(tmp_path_factory.mktemp("nats")), "nats-server")
    yield proc
    proc.stop()


@pytest.fixture
def nats_fresh(tmp_path: Path) -> Iterator[NatsProc]:
    """A private nats-server the test may stop, restart or kill."""
    proc = _service_or_skip(lambda: start_nats(tmp_path), "nats-server")
    yield proc
    proc.stop()
