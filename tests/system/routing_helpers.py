"""Which worker instance served a request, for the KV-routing system tests (test_kv_routing.py,
test_vllm_kv_routing.py, test_lora.py): the frontend's /health counts requests per instance;
what a model's router holds, from /metrics."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx

from tests.system.test_distributed import Frontend, instances

# A long shared system prompt, so that a conversation's opening fills several KV blocks.
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in short sentences, quote the "
    "relevant policy section, and never promise delivery dates that the tracking system has not "
    "confirmed. Customers may write in any language; answer in theirs."
)


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


def router_metric(frontend: Frontend, name: str, model: str) -> float:
    """`dynamo_frontend_router_{name}` of `model`'s (decode) router, from the frontend's /metrics."""
    text = httpx.get(f"{frontend.base_url}/metrics", timeout=10).text
    pattern = rf'^dynamo_frontend_router_{name}\{{model="{re.escape(model)}",pool="decode"\}} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0
