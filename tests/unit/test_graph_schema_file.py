"""The committed JSON Schema of graph files must match the pydantic models it is generated from."""

from __future__ import annotations

from pathlib import Path

from dynamo_graph.graph.schema import dump_json_schema

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "schemas" / "graph.schema.json"


def test_schema_file_is_current() -> None:
    regenerate = "python -m dynamo_graph.graph.schema > schemas/graph.schema.json"
    committed = SCHEMA_FILE.read_text() if SCHEMA_FILE.exists() else ""
    assert committed == dump_json_schema(), f"{SCHEMA_FILE.name} is stale; regenerate it: {regenerate}"
