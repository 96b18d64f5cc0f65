"""Shared fixtures. The tiny model is real (tokenizer, safetensors, GGUF) and built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_graph.dev.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-model folder (HF files + tiny-llama-f32.gguf). Set DYNGRAPH_TINY_MODEL=DIR to build
    it once into DIR and reuse it across sessions."""
    reuse = os.environ.get("DYNGRAPH_TINY_MODEL")
    out = Path(reuse) if reuse else tmp_path_factory.mktemp("tiny-model")
    return ensure_tiny_model(out)
