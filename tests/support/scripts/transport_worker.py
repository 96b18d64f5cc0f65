"""A request-plane worker in its own process, for transport tests and benchmarks.

    python -m tests.support.scripts.transport_worker tcp|nats RECORD_FILE [--nats-url URL] [--log FILE]

Serves subject `test.echo.generate` and writes its transport record as JSON to RECORD_FILE
once it is listening. The request body is JSON {"n", "delay_s", "tag", "paced"}: the handler
yields `n` frames b"<tag>:<i>", sleeping `delay_s` before each (with "paced" and no delay, it
yields to the event loop between frames, so each frame leaves in its own write, as tokens of a
real engine do). When its Context stops it appends
"cancelled <request id>" to the log file (if given) and ends, the way an engine runs its abort.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.transport import create_server

SUBJECT = "test.echo.generate"


def make_handler(log_path: Path | None):
    async def echo(body: bytes, headers: dict[str, str], context: Context) -> AsyncIterator[bytes]:
        request = json.loads(body)
        n, delay_s, tag = request["n"], request.get("delay_s", 0.0), request.get("tag", "")
        paced = request.get("paced", False)
        prefix = tag.encode() + b":"
        for i in range(n):
            if paced and not delay_s:
                await asyncio.sleep(0)
            elif delay_s:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay_s):
                        await context.stopped()
            if context.is_stopped():
                if log_path is not None:
                    with log_path.open("a") as log:
                        log.write(f"cancelled {context.id}\n")
                return
            yield prefix + str(i).encode()

    return echo


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["tcp", "nats"])
    parser.add_argument("record_file", type=Path)
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--log", type=Path)
    args = parser.parse_args()
    server = create_server(args.kind, **({"url": args.nats_url} if args.kind == "nats" else {}))
    await server.start()
    record = server.register(SUBJECT, make_handler(args.log))
    tmp = args.record_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"record": record, "pid": os.getpid()}))
    tmp.rename(args.record_file)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    await done.wait()
    await server.stop(grace_s=1.0)


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
