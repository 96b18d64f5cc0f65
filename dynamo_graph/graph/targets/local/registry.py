"""Which graphs run on this machine, for `dyngraph ls`: each supervisor (foreground or detached)
enters its state dir here when it starts and leaves when it stops.

A graph's state lives next to its file, anywhere on disk, so the supervisors keep this one list:
a folder (`DYNGRAPH_REGISTRY`, default `$XDG_STATE_HOME/dyngraph/running`, i.e.
`~/.local/state/dyngraph/running`) with one small JSON file per running graph. An entry whose
supervisor was killed before it could leave stays until `ls` finds the graph stopped, so such a
graph is listed (with what it left running) rather than forgotten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from dynamo_graph.graph.targets.local.state import atomic_write

REGISTRY_ENV = "DYNGRAPH_REGISTRY"


def registry_dir() -> Path:
    if configured := os.environ.get(REGISTRY_ENV):
        return Path(configured)
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "dyngraph" / "running"


def _entry(state_root: Path) -> Path:
    return registry_dir() / f"{hashlib.sha1(str(state_root).encode()).hexdigest()[:16]}.json"


def enter(state_root: Path) -> None:
    atomic_write(_entry(state_root), json.dumps({"state_dir": str(state_root)}) + "\n")


def leave(state_root: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        _entry(state_root).unlink()


def entered() -> list[Path]:
    """State dirs of the graphs entered and not left, by path."""
    found = []
    for entry in sorted(registry_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):  # half-written or foreign: not ours
            found.append(Path(json.loads(entry.read_text())["state_dir"]))
    return sorted(found)
