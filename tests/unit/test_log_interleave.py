"""`dyngraph logs` (without -f) interleaves processes' logs by the time on their lines."""

from __future__ import annotations

import calendar
import json
import logging
import time

from dynamo_graph.graph.targets.local.logs import interleaved, line_time
from dynamo_graph.log import _JsonFormatter, _TextFormatter

T0 = calendar.timegm((2026, 11, 24, 14, 50, 0, 0, 0, 0))


def _record(created: float, message: str) -> logging.LogRecord:
    record = logging.LogRecord("dynamo_graph.x", logging.INFO, __file__, 1, message, None, None)
    record.created, record.msecs = created, (created % 1) * 1000
    return record


def test_times_of_the_formats_our_processes_write() -> None:
    ours = _TextFormatter().format(_record(T0 + 0.25, "serving model"))
    assert line_time(ours) == T0 + 0.25
    assert line_time(_JsonFormatter().format(_record(T0 + 1.5, "x"))) == T0 + 1.5
    etcd = json.dumps({"level": "warn", "ts": "2026-11-24T14:50:02.500000Z", "msg": "slow fdatasync"})
    assert line_time(etcd) == T0 + 2.5
    local = time.mktime((2026, 11, 24, 14, 50, 3, 0, 0, -1))  # nats-server writes local time
    assert line_time("[4242] 2026/11/24 14:50:03.125000 [INF] Server is ready") == local + 0.125
    assert line_time("--- dyngraph: started backend-0 (run 1) at 2026-11-24T14:50:04.000Z ---") == T0 + 4
    assert line_time("2026-11-24T15:50:05+01:00 offset") == T0 + 5
    assert line_time("Traceback (most recent call last):") is None
    assert line_time('{"no": "time"}') is None


def test_interleaved_by_time_each_log_in_its_own_order() -> None:
    frontend = [
        "2026-11-24T14:50:01.000Z  INFO frontend: listening",
        "2026-11-24T14:50:04.000Z  INFO frontend: model added",
    ]
    backend = [
        "a line before any timestamp",
        "2026-11-24T14:50:02.000Z  INFO worker: loading",
        "Traceback (most recent call last):",
        "2026-11-24T14:50:03.000Z  INFO worker: serving model",
        "2026-11-24T14:50:00.500Z  INFO worker: a clock that stepped back stays in place",
    ]
    merged = interleaved({"frontend-0": frontend, "backend-0": backend})
    assert merged == [
        ("frontend-0", frontend[0]),
        ("backend-0", backend[0]),
        ("backend-0", backend[1]),
        ("backend-0", backend[2]),
        ("backend-0", backend[3]),
        ("backend-0", backend[4]),
        ("frontend-0", frontend[1]),
    ]
    assert interleaved({"a": ["x", "y"], "b": ["z"]}) == [("a", "x"), ("a", "y"), ("b", "z")]
