"""Where a graph keeps its state: importable without the graph loader (Hydra, pydantic), so that
`up -d`, `status`, `logs` and `down` can find a graph's supervisor before (or without) loading it;
and where the checkout keeps the tiny test model."""

from __future__ import annotations

import os
from pathlib import Path


def state_dir(graph_file: str | Path) -> Path:
    """`<graph dir>/.dyngraph/<graph file stem>/`: where the supervisor keeps the resolved graph,
    plan, pids, logs and the file-discovery root. Not created here."""
    file = Path(os.path.abspath(graph_file))
    return file.parent / ".dyngraph" / file.stem


TINY_MODEL_DIR = "tiny-model"  # the folder name `make run` and the shipped graphs give the tiny test model
CHECKOUT_TINY_MODEL = Path(__file__).resolve().parents[2] / ".cache" / TINY_MODEL_DIR
"""Where `make tiny-model` (and `make run`) build it in dyngraph's checkout."""
