"""Waiting for a condition instead of sleeping a fixed time.

Tests poll until what they need has happened and fail, naming what they waited for, after a
timeout: a slow machine then costs time, not a flaky failure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.05


def wait_for(check: Callable[[], object], timeout: float, what: str, *, poll: float = POLL_S) -> float:
    """Seconds until `check()` is true; AssertionError naming `what` after `timeout` seconds."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic() - start


async def wait_for_async(
    check: Callable[[], object], timeout_s: float, what: str, *, poll: float = POLL_S
) -> float:
    """`wait_for` inside an event loop: other tasks run between the checks."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll)
    return time.monotonic() - start
