"""A pytok engine file (`out=pytok:tests/support/scripts/wedge_engine.py`) that a test can wedge: while the
file named by WEDGE_FILE exists, every request (health checks included) hangs without a word,
as a stuck engine does, while the worker process, its lease and its registration stay alive.
Otherwise it streams the prompt's last tokens back, up to max_tokens (ignoring eos), one every
TOKEN_DELAY_S; with PEAK_FILE set, it writes there the most requests it ever had at once."""

import asyncio
import os

WEDGE = os.environ.get("WEDGE_FILE", "/nonexistent/wedge")
DELAY_S = float(os.environ.get("TOKEN_DELAY_S", "0.001"))
PEAK_FILE = os.environ.get("PEAK_FILE")
inflight = 0
peak = 0


async def generate(request):
    global inflight, peak
    while os.path.exists(WEDGE):  # noqa: ASYNC110, ASYNC240 - a tiny marker file, polled on purpose
        await asyncio.sleep(0.05)
    inflight += 1
    if inflight > peak:
        peak = inflight
        if PEAK_FILE:
            with open(PEAK_FILE, "w") as f:  # noqa: ASYNC230 - a tiny test file
                f.write(str(peak))
    try:
        tail = request["token_ids"][-4:] or [1]
        limit = (request["stop_conditions"] or {}).get("max_tokens") or 8
        for i in range(limit):
            await asyncio.sleep(DELAY_S)
            yield {"token_ids": [tail[i % len(tail)]]}
        yield {"token_ids": [], "finish_reason": "length"}
    finally:
        inflight -= 1
