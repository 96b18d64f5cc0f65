"""Logging configured the way Dynamo users expect: `DYN_LOG` with RUST_LOG syntax.

`DYN_LOG=debug`, `DYN_LOG=warn,dynamo_graph.frontend=debug` (Rust-style `::` separators are
accepted too), `-v` = debug, `-vv` = trace. `DYN_LOGGING_JSONL=1` switches to one JSON object
per line for log shippers.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
# Third-party loggers that are chatty at info and carry nothing a user of dyngraph needs.
_QUIET = ("uvicorn.access", "httpx", "httpcore", "huggingface_hub", "asyncio")


class LogSpecError(ValueError):
    """A `DYN_LOG` value that is not RUST_LOG syntax."""


def parse_log_spec(spec: str) -> tuple[int, dict[str, int]]:
    """Parse `level[,target=level...]` into a default level and per-logger levels."""
    default = logging.INFO
    targets: dict[str, int] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        target, sep, level = item.rpartition("=")
        if not sep:
            if item.lower() in _LEVELS:
                default = _LEVELS[item.lower()]
                continue
            # A bare target means "everything from it", as in RUST_LOG.
            targets[item.replace("::", ".")] = TRACE
            continue
        if level.lower() not in _LEVELS:
            raise LogSpecError(f"DYN_LOG: unknown level {level!r} in {item!r} (use {', '.join(_LEVELS)})")
        targets[target.replace("::", ".")] = _LEVELS[level.lower()]
    return default, targets


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{ts}.{int(record.msecs):03d}Z {record.levelname:>5} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": record.created,
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(verbosity: int = 0, spec: str | None = None) -> None:
    """Configure the root logger from -v flags and DYN_LOG (DYN_LOG's targets win)."""
    spec = os.environ.get("DYN_LOG", "") if spec is None else spec
    default, targets = parse_log_spec(spec)
    if verbosity == 1:
        default = min(default, logging.DEBUG)
    elif verbosity >= 2:
        default = TRACE
    handler = logging.StreamHandler(sys.stderr)
    jsonl = os.environ.get("DYN_LOGGING_JSONL", "").lower() in ("1", "true", "yes")
    handler.setFormatter(_JsonFormatter() if jsonl else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(default)
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(default, logging.WARNING))
    for name, level in targets.items():
        logging.getLogger(name).setLevel(level)
