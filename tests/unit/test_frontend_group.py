"""Frontend processes of one port answer /metrics for each other (frontend/group.py): real
FrontendMetrics, real Unix sockets, two members in one event loop told apart by their ids."""

from __future__ import annotations

import asyncio
import socket

from prometheus_client.parser import text_string_to_metric_families

from dynamo_graph.frontend.group import FrontendGroup
from dynamo_graph.frontend.metrics import FrontendMetrics
from dynamo_graph.graph.metric_expr import parse_metric_expr


def _requests(metrics: FrontendMetrics, n: int) -> None:
    for _ in range(n):
        metrics.model("m").count_request("chat_completions", "stream", "success")


def test_one_scrape_holds_every_member_labelled_by_pid(tmp_path) -> None:
    async def scrape() -> tuple[str, str]:
        a, b = FrontendMetrics(), FrontendMetrics()
        _requests(a, 2)
        _requests(b, 3)
        b.model("m").ttft.observe(0.02)
        members = [
            FrontendGroup(f"unit-{tmp_path.name}", m.registry, member=i) for i, m in ((11, a), (22, b))
        ]
        for member in members:
            await member.start()
        # A socket whose process was killed (-9): nothing listens; the scrape removes it.
        stale = members[0].dir / "33.sock"
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(stale))
        try:
            a.group = members[0]
            b.group = members[1]
            texts = (await a.scrape()).decode(), (await b.scrape()).decode()
        finally:
            for member in members:
                await member.close()
        assert not stale.exists()
        assert not members[0].dir.exists()  # the last member out removed the folder
        return texts

    from_a, from_b = asyncio.run(scrape())
    assert from_a == from_b  # whichever process answers
    requests = {
        s.labels["pid"]: s.value
        for f in text_string_to_metric_families(from_a)
        for s in f.samples
        if s.name == "dynamo_frontend_requests_total"
    }
    assert requests == {"11": 2.0, "22": 3.0}
    ttft = parse_metric_expr('dynamo_frontend_time_to_first_token_seconds_count{pid="22"} == 1')
    assert ttft.holds(ttft.value(from_a) or 0)
    total = parse_metric_expr('dynamo_frontend_requests_total{model="m"} == 5')
    assert total.holds(total.value(from_a) or 0)
    assert "dynamo_frontend_group_processes 2.0" in from_a


def test_without_a_group_the_scrape_is_the_process_own() -> None:
    metrics = FrontendMetrics()
    _requests(metrics, 1)
    text = asyncio.run(metrics.scrape())
    assert text == metrics.render() and b'pid="' not in text


def test_a_long_group_name_still_fits_a_socket_path() -> None:
    async def start_and_scrape() -> bytes:
        member = FrontendGroup("ns-" + "x" * 200 + ".frontend", FrontendMetrics().registry, member=7)
        await member.start()  # a 200-character folder would pass the 107 bytes of a socket path
        try:
            return await member.scrape()
        finally:
            await member.close()

    assert b"dynamo_frontend_group_processes 1.0" in asyncio.run(start_and_scrape())
