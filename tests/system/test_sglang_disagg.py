"""SGLang prefill/decode served end to end, on real processes, with SGLang replaced at its Python
API by tests/support/fake_sglang (SGLang cannot be installed here): `dyngraph test` brings up a
frontend, two SGLang prefill workers and a decode worker and sends its default checks (models, a
chat, a streamed chat, a completion). The fake pairs the halves of a request as SGLang does, over
a real TCP bootstrap server on the port the compiler gave each prefill worker, and logs what it
was asked: every generated answer came from a decode request paired with a prefill request of
the same room, on that prefill worker's bootstrap address."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import yaml

from tests.support.engine_adapters import sglang_pd_worker
from tests.support.processes import free_port, run_cli

FAKE_SGLANG = Path(__file__).resolve().parents[1] / "support" / "fake_sglang"


def test_sglang_prefill_and_decode_pair_by_bootstrap_room(tmp_path: Path, tiny_model: Path) -> None:
    graph = {
        "name": "sglang-pd",
        "models": {"tiny": {"path": str(tiny_model)}},
        "components": {
            "frontend": {
                "kind": "frontend",
                "http": {"port": free_port()},
                "disagg": {"enforce": True},
                "depends_on": ["decode", "prefill"],
            },
            "prefill": sglang_pd_worker("tiny", "prefill", replicas=2),
            "decode": sglang_pd_worker("tiny", "decode"),
        },
    }
    graph_file = tmp_path / "sglang-pd.yaml"
    graph_file.write_text(yaml.safe_dump(graph))
    log = tmp_path / "sglang.jsonl"
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), os.environ.get("PYTHONPATH", "")]),
        "FAKE_SGLANG_LOG": str(log),
    }
    junit = tmp_path / "junit.xml"
    tested = run_cli(["test", str(graph_file), "--junit", str(junit)], env=env, timeout=180)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert len(cases) >= 4 and not [
        c for c in cases if c.find("failure") is not None or c.find("error") is not None
    ]

    records = [json.loads(line) for line in log.read_text().splitlines()]
    rooms: dict[int, dict[str, dict]] = defaultdict(dict)
    for r in records:
        if r["bootstrap_host"] != "2.2.2.2":  # health checks run alone, under SGLang's fake host
            rooms[r["bootstrap_room"]][r["mode"]] = r
    assert len(rooms) >= 3  # a chat, a streamed chat, a completion
    ports = set()
    for pair in rooms.values():
        prefill, decode = pair["prefill"], pair["decode"]  # both halves of every request
        assert (prefill["bootstrap_host"], prefill["bootstrap_port"]) == (
            decode["bootstrap_host"],
            decode["bootstrap_port"],
        )
        assert decode["bootstrap_host"] == "127.0.0.1" and prefill["max_new_tokens"] == 1
        ports.add(decode["bootstrap_port"])
    assert len(ports) == 2 and 8998 not in ports  # each prefill worker its own allocated port
