"""Distributed tracing end to end: requests that bring a W3C `traceparent` come back as one trace
from every process they crossed (frontend, workers; the prefill -> decode hand-off), received by a
real OTLP/HTTP endpoint, with each span's parent where the request came from; and a
single-process `dyngraph run in=http out=ENGINE` traced from its `--otlp-endpoint` flags."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.disagg_cluster import LONG, start_disagg
from tests.support.mocker_cluster import start_cluster
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.processes import echo_core_args, running_server
from tests.support.waiting import wait_for

SERVER, CLIENT = 2, 3  # the OTLP proto's SpanKind values
COUNT = "POST /v1/messages/count_tokens"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    """The OTLP endpoint, named to every process the tests start through the SDK's own env."""
    otlp = OtlpReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, not the SDK's 5 s
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",  # only traces a client sampled are kept: ours
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield otlp
    otlp.stop()


def _client(base_url: str, trace_id: str, parent: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key="none",
        default_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        max_retries=0,
    )


def _one(spans: list[ReceivedSpan], name: str, **where: object) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (name, where, [(s.name, s.pid, s.parent_id) for s in spans])
    return found[0]


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_id == parent.span_id and s.name == name]


def _orphans(spans: list[ReceivedSpan], client_span: str) -> list[tuple[str, str, str]]:
    """Spans whose parent is not in the trace, but the frontend's, whose parent is the client's.
    Until every process's exporter has flushed, a child can arrive before its parent (a client
    call span ends after the HTTP span that opened it)."""
    ids = {s.span_id for s in spans}
    return [
        (s.name, s.service, s.parent_id)
        for s in spans
        if s.parent_id not in ids and s.parent_id != client_span
    ]


def _linked(spans: list[ReceivedSpan], client_span: str) -> None:
    """Every span's parent is in the trace, but the frontend's, whose parent is the client's."""
    assert not _orphans(spans, client_span)


def test_two_workers_one_trace(tmp_path: Path, tiny_model: Path, receiver: OtlpReceiver) -> None:
    """Two requests of one client trace through a round-robin frontend reach both workers."""
    cluster = start_cluster(tmp_path, tiny_model, workers=2, limit=None)
    try:
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        with _client(cluster.frontend.base_url, trace_id, parent) as client:
            for i in range(2):
                answer = client.completions.create(model=cluster.model, prompt=f"Hello {i}", max_tokens=4)
                assert answer.usage is not None and answer.usage.completion_tokens == 4
        # A route of another API surface that calls no worker is traced too.
        headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
        with anthropic.Anthropic(
            base_url=cluster.frontend.base_url, api_key="none", default_headers=headers
        ) as an:
            counted = an.messages.count_tokens(
                model=cluster.model, messages=[{"role": "user", "content": "Hi"}]
            )
        assert counted.input_tokens > 0
        front, pids = cluster.frontend.proc.pid, {w.proc.pid for w in cluster.workers}
        ends = ("generate", "POST /v1/completions", COUNT)  # the last span each process ends
        wait_for(
            lambda: (
                sorted(s.pid for s in receiver.trace(trace_id) if s.name in ends)
                == sorted([front, front, front, *pids])
                and not _orphans(receiver.trace(trace_id), parent)
            ),
            20,
            "both requests' frontend spans and the generate spans of both workers, each with its parent",
        )
        spans = receiver.trace(trace_id)
    finally:
        cluster.stop()
    assert {s.pid for s in spans} == {front, *pids}
    _linked(spans, parent)
    count = _one(spans, COUNT, parent_id=parent)
    assert count.attributes["http.response.status_code"] == 200
    assert [s.name for s in spans if s.parent_id == count.span_id] == ["preprocess"]
    https = [s for s in spans if s.name == "POST /v1/completions"]
    assert len(https) == 2 and all(
        h.parent_id == parent and h.kind == SERVER and h.pid == front for h in https
    )
    assert all(h.attributes["http.response.status_code"] == 200 for h in https)
    for http in https:
        (pre,) = _children(spans, http, "preprocess")
        assert pre.attributes["llm.prompt_tokens"] > 0
        (call,) = _children(spans, http, "call dyn://mig.mocker.generate")
        assert call.kind == CLIENT and call.pid == front
        (serve,) = _children(spans, call, "serve dyn://mig.mocker.generate")
        assert serve.kind == SERVER and serve.pid in pids
        (generate,) = _children(spans, serve, "generate")
        assert generate.pid == serve.pid and "first_token" in generate.events
        assert generate.attributes["llm.completion_tokens"] == 4
        # The worker is the instance the frontend called.
        assert serve.attributes["request.id"]
        pids.discard(serve.pid)
    assert not pids  # one request on each worker


def test_prefill_decode_one_trace(tmp_path: Path, tiny_model: Path, receiver: OtlpReceiver) -> None:
    """A disaggregated request: prefill worker, decode worker and the KV fetch between them."""
    cluster = start_disagg(tmp_path, tiny_model, prefill=1, decode=1)
    try:
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        with _client(cluster.frontend.base_url, trace_id, parent) as client:
            answer = client.completions.create(model=cluster.model, prompt=LONG + "Question?", max_tokens=6)
        assert answer.usage is not None and answer.usage.completion_tokens == 6
        front = cluster.frontend.proc.pid
        (prefill_pid,), (decode_pid,) = (
            [w.proc.pid for w in cluster.prefill],
            [w.proc.pid for w in cluster.decode],
        )
        wait_for(
            lambda: (
                {"POST /v1/completions", "generate", "prefill", "serve dyn://pd.prefill.kv_fetch"}
                <= {s.name for s in receiver.trace(trace_id)}
                and not _orphans(receiver.trace(trace_id), parent)
            ),
            20,
            "the frontend's and the workers' last spans, each with its parent",
        )
        spans = receiver.trace(trace_id)
    finally:
        cluster.stop()
    assert {s.pid for s in spans} == {front, prefill_pid, decode_pid}
    _linked(spans, parent)
    http = _one(spans, "POST /v1/completions", parent_id=parent)
    routes = [s for s in spans if s.name == "route"]
    assert routes and all(r.pid == front and r.attributes["router.mode"] == "kv" for r in routes)
    assert all(
        r.attributes["router.candidates"] == 1 and "router.overlap_blocks" in r.attributes for r in routes
    )
    # frontend -> prefill worker
    (remote,) = _children(spans, http, "remote_prefill")
    (to_prefill,) = _children(spans, remote, "call dyn://pd.prefill.generate")
    (served_prefill,) = _children(spans, to_prefill, "serve dyn://pd.prefill.generate")
    assert served_prefill.pid == prefill_pid
    assert _children(spans, served_prefill, "prefill")
    assert any(
        r.attributes["router.worker.instance_id"] == to_prefill.attributes["instance.id"] for r in routes
    )
    # frontend -> decode worker -> (KV fetch) -> prefill worker
    (to_decode,) = _children(spans, http, "call dyn://pd.backend.generate")
    (served_decode,) = _children(spans, to_decode, "serve dyn://pd.backend.generate")
    assert served_decode.pid == decode_pid
    (generate,) = _children(spans, served_decode, "generate")
    (transfer,) = _children(spans, generate, "kv_transfer")
    assert transfer.attributes["kv.bytes"] > 0 and "kv.error" not in transfer.attributes
    (fetch,) = _children(spans, transfer, "call dyn://pd.prefill.kv_fetch")
    assert fetch.pid == decode_pid
    (served_fetch,) = _children(spans, fetch, "serve dyn://pd.prefill.kv_fetch")
    assert served_fetch.pid == prefill_pid


def test_a_single_process_run_is_traced_from_its_flags(
    tmp_path: Path, tiny_model: Path, receiver: OtlpReceiver
) -> None:
    """The flags write the SDK's variables, as a graph's `observability` section does: no OTEL_*
    endpoint in this process's environment, the ratio 0 keeping only the client's sampled trace."""
    unset = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_TRACES_SAMPLER": "", "OTEL_TRACES_SAMPLER_ARG": ""}
    flags = ["--otlp-endpoint", receiver.endpoint, "--trace-sample-ratio", "0"]
    args = echo_core_args(tiny_model, "tiny-model", *flags)
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    with running_server(args, log_dir=tmp_path, env=unset) as server:
        pid = server.proc.pid
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as plain:
            plain.completions.create(model="tiny-model", prompt="not traced", max_tokens=2)  # sampled out
        with _client(server.base_url, trace_id, parent) as client:
            stream = client.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        names = {"POST /v1/chat/completions", "preprocess", "generate"}
        wait_for(lambda: names <= {s.name for s in receiver.trace(trace_id)}, 20, "the process's spans")
    spans = receiver.trace(trace_id)
    assert {s.pid for s in spans} == {pid} and {s.service for s in spans} == {"dyngraph"}
    assert not [s for s in receiver.spans if s.pid == pid and s.trace_id != trace_id]  # ratio 0
    http = _one(spans, "POST /v1/chat/completions", parent_id=parent)
    assert http.kind == SERVER and http.attributes["http.response.status_code"] == 200
    (pre,) = _children(spans, http, "preprocess")
    assert pre.attributes["llm.prompt_tokens"] > 0
    (generate,) = _children(spans, http, "generate")
    assert "first_token" in generate.events and generate.attributes["llm.completion_tokens"] == 4
    assert generate.attributes["llm.prompt_tokens"] == pre.attributes["llm.prompt_tokens"]
