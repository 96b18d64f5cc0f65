"""What a frontend's Prometheus /metrics page says, for tests that check counters and gauges."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import Frontend


def scrape(frontend: Frontend | str) -> str:
    """The frontend's /metrics text; `frontend` is an object with `base_url` or the URL itself."""
    url = frontend if isinstance(frontend, str) else frontend.base_url
    return httpx.get(f"{url}/metrics", timeout=10).text


def metric(frontend: Frontend | str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (a histogram's `_count`, a counter's `_total`) whose
    labels include `labels`; 0 when there is none."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(scrape(frontend))
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def router_metric(frontend: Frontend | str, name: str, model: str) -> float:
    """`dynamo_frontend_router_{name}` of `model`'s decode router."""
    return metric(frontend, f"dynamo_frontend_router_{name}", model=model, pool="decode")
