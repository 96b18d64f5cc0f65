"""Recording the requests a frontend serves (`--record`, a graph frontend's `record:`), as a
trace that `dyngraph bench --trace` replays against another graph.

One line per request answered successfully, in the mooncake format bench/workload.py reads:

    {"timestamp": 1764380000123, "input_length": 812, "output_length": 64,
     "hash_ids": [8017…, 1293…], "model": "m", "session_id": "s-1", "api": "chat_completions"}

`timestamp` is the arrival in milliseconds since the epoch (the replay counts from the first
line, so several frontends' traces merge by sorting); `hash_ids` are the chained hashes of the
prompt's whole `block_size`-token blocks (the router's block hashing), so two requests sharing
a prefix share their leading ids and the replay's prompts share a prefix as long. With
`record_text` the client's `messages` or `prompt` go too. Lines go through the same background
writer as the decision log (runtime/jsonl.py), without rotation: a trace is kept whole.
"""

from __future__ import annotations

from typing import Any

from dynamo_graph.frontend.settings import RecordSettings
from dynamo_graph.llm.pipeline import Prepared
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.runtime.jsonl import JsonLines


class Recorder:
    def __init__(self, settings: RecordSettings) -> None:
        assert settings.path is not None
        self.block_size = settings.block_size
        self.text = settings.record_text
        self.lines = JsonLines(settings.path)

    @classmethod
    def open(cls, settings: RecordSettings) -> Recorder | None:
        return cls(settings) if settings.path else None

    def record(self, arrival: float, api: str, prepared: Prepared, request: Any) -> None:
        """One served request: arrived at `arrival` (epoch seconds) on `api`; `request` as the
        client sent it."""
        pre = prepared.preprocessed
        hints = pre.routing if pre is not None else None
        line: dict[str, Any] = {
            "timestamp": round(arrival * 1000),
            "input_length": prepared.prompt_tokens,
            "output_length": prepared.completion_tokens,
            "hash_ids": self.hash_ids(pre.token_ids) if pre is not None else [],
            "model": prepared.request.model,
            "session_id": hints.session_id if hints is not None else None,
            "api": api,
        }
        if self.text:
            for name in ("messages", "prompt", "input"):
                value = getattr(request, name, None)
                if value is not None:
                    line[name] = value
                    break
        self.lines.write(line)

    def hash_ids(self, token_ids: list[int]) -> list[int]:
        """The chained hashes of the prompt's whole blocks (a partial last block has none)."""
        return sequence_hashes(local_block_hashes(token_ids, self.block_size))

    def close(self) -> None:
        self.lines.close()
