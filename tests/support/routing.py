"""Which worker instances a frontend routes to, and which one served a request: the frontend's
/health lists them with a request count each. Conversation openings long enough to fill several
KV blocks, for the KV-routing tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import httpx

from tests.support.processes import Frontend, ServerProcess, WorkerProcess
from tests.support.waiting import wait_for

# A long shared system prompt, so that a conversation's opening fills several KV blocks.
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in short sentences, quote the "
    "relevant policy section, and never promise delivery dates that the tracking system has not "
    "confirmed. Customers may write in any language; answer in theirs."
)


def instances(frontend: Frontend, model: str) -> list[dict]:
    """`model`'s routable worker instances, as the frontend's /health lists them."""
    health = httpx.get(f"{frontend.base_url}/health", timeout=5).json()
    details = health.get("details", {}).get(model)
    return details["instances"] if details else []


@contextmanager
def routing_to(
    frontend: ServerProcess, workers: Sequence[WorkerProcess], model: str
) -> Iterator[ServerProcess]:
    """`frontend` once it lists every one of `workers` as an instance of `model`; all of them
    stopped afterwards."""
    try:
        frontend.wait_ready(path="/live")
        wait_for(
            lambda: len(instances(frontend, model)) == len(workers), 30, f"{len(workers)} workers of {model}"
        )
        yield frontend
    finally:
        frontend.stop()
        for worker in workers:
            worker.stop()


def opening_messages(conv: int) -> list[dict]:
    """Conversation `conv`'s first turn: its own long opening, so that only its own history is shared."""
    return [
        {"role": "system", "content": f"Conversation {conv}. {SYSTEM} Ticket {conv * 7919}."},
        {"role": "user", "content": f"Where is parcel {conv}? It left the depot {conv + 2} days ago."},
    ]


def requests_per_instance(frontend: Frontend, model: str) -> dict[str, int]:
    return {i["instance_id"]: i["requests"] for i in instances(frontend, model)}


def served_by(frontend: Frontend, model: str, send: Callable[[], dict]) -> tuple[str, dict]:
    """Run `send` and return the one instance whose request count it changed, with what `send` returned."""
    before = requests_per_instance(frontend, model)
    body = send()
    after = requests_per_instance(frontend, model)
    changed = [i for i in after if after[i] != before.get(i, 0)]
    assert len(changed) == 1, (before, after)
    return changed[0], body
