"""What the server says about a benchmark: its models, and what its /metrics counted during a
load point (the frontend's request counter and token histograms), to set beside what the client
counted."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "dynamo_frontend_requests"
OUTPUT_TOKENS = "dynamo_frontend_output_sequence_tokens"
INPUT_TOKENS = "dynamo_frontend_input_sequence_tokens"


class ServerError(RuntimeError):
    """The server could not be asked (not running, wrong URL, no such model)."""


@dataclass(frozen=True)
class Endpoint:
    """A frontend's base URL split into what the load generator dials."""

    url: str  # http://host:port (no trailing /v1)
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ServerError(f"--url must be http://HOST:PORT[/v1], not {url!r}")
        port = parts.port or 80
        return cls(f"http://{parts.hostname}:{port}", parts.hostname, port)


def _get(url: str, headers: dict[str, str], timeout: float = 10.0) -> bytes:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as e:
        raise ServerError(f"GET {url}: {getattr(e, 'reason', e)}") from None


def served_models(endpoint: Endpoint, headers: dict[str, str]) -> list[str]:
    data = json.loads(_get(f"{endpoint.url}/v1/models", headers))
    return [m["id"] for m in data.get("data", [])]


def scrape(endpoint: Endpoint, headers: dict[str, str], model: str) -> dict[str, float] | None:
    """The model's counters now: requests by status, input and output token sums; None when the
    server has no /metrics (not a dyngraph frontend)."""
    try:
        text = _get(f"{endpoint.url}/metrics", headers).decode()
    except ServerError:
        return None
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name == f"{REQUESTS}_total":
                key = f"requests_{sample.labels.get('status', 'unknown')}"
                counts[key] = counts.get(key, 0.0) + sample.value
            elif sample.name in (f"{OUTPUT_TOKENS}_sum", f"{INPUT_TOKENS}_sum"):
                key = "output_tokens" if sample.name.startswith(OUTPUT_TOKENS) else "input_tokens"
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int] | None:
    """What the server counted between two scrapes."""
    if before is None or after is None:
        return None
    out = {k: round(after.get(k, 0.0) - before.get(k, 0.0)) for k in sorted(set(before) | set(after))}
    out["requests"] = sum(v for k, v in out.items() if k.startswith("requests_"))
    return out
