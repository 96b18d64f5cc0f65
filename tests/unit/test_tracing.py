"""Tracing's parts without processes: the carrier a request frame takes (a span's carrier, extract), spans
under a request's Context, the sampling and endpoint configuration from OTEL_* and from a graph,
and that with tracing off nothing of OpenTelemetry is imported."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dynamo_graph.graph.compile import compile_graph
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.validate import validate_graph
from dynamo_graph.options import given_fields
from dynamo_graph.process.run_config import RunConfigError, parse_run_config
from dynamo_graph.router.migration import Migration
from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.settings import TracingSettings
from dynamo_graph.runtime.transport.base import StreamBroken
from tests.support.scripted_router import Attempt, FakeRouter
from tests.support.scripted_router import scripted_request as _request
from tests.support.scripted_router import tagged as _tagged
from tests.support.scripted_router import tokens as _tokens

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, exporting to memory (not through `setup`: its provider is global)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "ON", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_propagator", TraceContextTextMapPropagator())
    yield exporter
    provider.shutdown()


def test_off_is_a_shared_no_op() -> None:
    context = Context()
    assert tracing.span("x", context) is tracing.NO_SPAN
    with tracing.span("x", context) as span:
        span.set("a", 1)
    assert context.trace is None
    assert tracing.span("call", context).carrier == {}
    assert tracing.extract({"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}) is None


def test_off_imports_nothing_of_opentelemetry() -> None:
    """The frontend's, router's and worker's modules load without OpenTelemetry when tracing is off."""
    code = (
        "import sys\n"
        "import dynamo_graph.process.launch, dynamo_graph.frontend.openai_asgi\n"
        "import dynamo_graph.frontend.remote, dynamo_graph.backend.handlers, dynamo_graph.router.disagg\n"
        "from dynamo_graph.runtime import tracing\n"
        "assert not tracing.setup('x')\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_carrier_crosses_the_request_plane(spans: InMemorySpanExporter) -> None:
    """Caller: the span open on the request's Context goes into the frame's headers; server: the
    headers' trace is the parent of the server span, which continues the client's trace."""
    caller = Context()
    with tracing.span("http", caller, headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}):
        call = tracing.span("call", caller, kind="client")
        headers = call.carrier
        call.end()
    assert caller.trace is None  # the span restored what it found
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    server = Context()
    with tracing.span("serve", server, kind="server", headers=headers), tracing.span("generate", server):
        pass
    got = {s.name: s for s in spans.get_finished_spans()}
    assert {s.context.trace_id for s in got.values()} == {int(TRACE_ID, 16)}
    assert got["http"].parent.span_id == int(PARENT, 16) and got["http"].parent.is_remote
    assert got["call"].parent.span_id == got["http"].context.span_id
    assert f"{got['call'].context.span_id:016x}" == span_id
    assert got["serve"].parent.span_id == got["call"].context.span_id
    assert got["generate"].parent.span_id == got["serve"].context.span_id


def test_a_frame_without_traceparent_extracts_nothing(spans: InMemorySpanExporter) -> None:
    assert tracing.extract({}) is None
    assert tracing.extract({"x-other": "1"}) is None
    with tracing.span("root", Context(), headers={"traceparent": "garbage"}):
        pass
    (root,) = spans.get_finished_spans()
    assert root.parent is None  # a broken carrier starts a new trace


def test_a_sampled_out_trace_makes_no_spans_below_it(spans: InMemorySpanExporter) -> None:
    """A client's trace that is not sampled (flags 00): the frontend's span is dropped, and the
    request's other span sites and its request-plane headers cost nothing."""
    context = Context()
    with tracing.span("http", context, headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-00"}) as http:
        assert not http.recording
        assert tracing.span("preprocess", context) is tracing.NO_SPAN
        assert tracing.span("call", context, kind="client").carrier == {}
        tracing.event(context, "migration")
    assert context.trace is None
    assert spans.get_finished_spans() == ()


def test_errors_and_cancellation(spans: InMemorySpanExporter) -> None:
    context = Context()
    with pytest.raises(ValueError), tracing.span("fails", context):
        raise ValueError("bad")
    with pytest.raises(GeneratorExit), tracing.span("abandoned", context):
        raise GeneratorExit
    got = {s.name: s for s in spans.get_finished_spans()}
    assert got["fails"].status.status_code is StatusCode.ERROR
    assert got["abandoned"].status.status_code is StatusCode.UNSET
    assert got["abandoned"].attributes["cancelled"] is True


async def test_served_streams_inside_a_server_span(spans: InMemorySpanExporter) -> None:
    context = Context("req-1")

    async def handler() -> AsyncIterator[int]:
        with tracing.span("generate", context):
            yield 1
            yield 2

    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
    assert [i async for i in tracing.served("serve ns.c.e", handler(), headers, context)] == [1, 2]
    got = {s.name: s for s in spans.get_finished_spans()}
    assert got["serve ns.c.e"].attributes["request.id"] == "req-1"
    assert got["generate"].parent.span_id == got["serve ns.c.e"].context.span_id


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_configured_by_the_sdk_variables(env: dict[str, str], on: bool) -> None:
    assert tracing.configured(env) is on


def test_sampling_from_the_sdk_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider's sampler is the SDK's from OTEL_TRACES_SAMPLER(_ARG): parent-based, so a
    client's sampled trace is followed while the frontend's own are kept at the ratio."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "decode")
    provider = tracing.tracer_provider("fallback")
    try:
        assert "TraceIdRatioBased{0.0}" in provider.sampler.get_description()
        assert provider.resource.attributes["service.name"] == "decode"
        tracer = provider.get_tracer("t")
        assert not tracer.start_span("own").is_recording()  # ratio 0: the frontend's own trace
        carrier = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
        followed = tracer.start_span("child", context=TraceContextTextMapPropagator().extract(carrier))
        assert followed.is_recording()
    finally:
        provider.shutdown()


def _graph(observability: dict | None) -> dict:
    backend = {"kind": "worker", "model": "tiny", "engine": "mocker", "env": {"OTEL_SERVICE_NAME": "be"}}
    components = {"frontend": {"kind": "frontend"}, "backend": backend}
    graph = {"name": "demo", "models": {"tiny": {"path": "./model"}}, "components": components}
    if observability is not None:
        graph["observability"] = observability
    return graph


def test_a_graph_sets_tracing_for_every_process(tmp_path: Path) -> None:
    graph = validate_graph(
        _graph({"otlp_endpoint": "http://collector:4318", "sample_ratio": 0.1}), None, file="graph.yaml"
    )
    plan = compile_graph(graph, graph_file=tmp_path / "graph.yaml", state_dir=tmp_path / "state")
    env = {p.component: p.env for p in plan.processes if p.component in ("frontend", "backend")}
    for process_env in env.values():
        assert process_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
        assert process_env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert process_env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
        assert process_env["OTEL_RESOURCE_ATTRIBUTES"] == "service.namespace=demo"
        assert tracing.configured(process_env)
    assert env["frontend"]["OTEL_SERVICE_NAME"] == "frontend"
    assert env["backend"]["OTEL_SERVICE_NAME"] == "be"  # the component's own env wins
    plain = validate_graph(_graph(None), None, file="graph.yaml")
    plan = compile_graph(plain, graph_file=tmp_path / "graph.yaml", state_dir=tmp_path / "state")
    assert not any(k.startswith("OTEL_") for p in plan.processes for k in p.env if k != "OTEL_SERVICE_NAME")


@pytest.mark.parametrize(
    ("observability", "key"),
    [({"otlp_endpoint": "collector:4318"}, "otlp_endpoint"), ({"sample_ratio": 1.5}, "sample_ratio")],
)
def test_a_bad_observability_section_names_its_key(observability: dict, key: str) -> None:
    with pytest.raises(GraphError, match=key):
        validate_graph(_graph(observability), None, file="graph.yaml")


def test_run_flags_write_the_sdk_variables_the_graph_section_does() -> None:
    """`dyngraph run --otlp-endpoint --trace-sample-ratio`: the graph's `observability` fields
    (one declaration); a flag not given leaves the environment's variable in charge."""
    cfg = parse_run_config(
        ["in=http", "out=echo", "--otlp-endpoint", "http://c:4318", "--trace-sample-ratio", "0.25"]
    )
    given = given_fields(TracingSettings, cfg.explicit)
    assert cfg.tracing.otel_env(given) == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    only = parse_run_config(["in=http", "out=echo", "--trace-sample-ratio", "0.5"])
    assert only.tracing.otel_env(given_fields(TracingSettings, only.explicit)) == {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    plain = parse_run_config(["in=http", "out=echo"])
    assert plain.tracing.otel_env(given_fields(TracingSettings, plain.explicit)) == {}
    with pytest.raises(RunConfigError, match="--otlp-endpoint: expected an http"):
        parse_run_config(["in=http", "out=echo", "--otlp-endpoint", "collector:4318"])
    with pytest.raises(RunConfigError, match="--trace-sample-ratio"):
        parse_run_config(["in=http", "out=echo", "--trace-sample-ratio", "2"])


async def test_a_migration_is_an_event_on_the_request_span(spans: InMemorySpanExporter) -> None:
    """Request migration (router/migration.py) marks the moment it moved the request."""
    fake = FakeRouter(
        [Attempt(_tokens(100, 2), _tagged(StreamBroken("lost"), 0xAB)), Attempt(_tokens(200, 2, "length"))]
    )
    context = Context()
    with tracing.span("http", context):
        outs = [out async for out in Migration(fake, 2).generate(_request(max_tokens=4), context)]
    assert [t for out in outs for t in out.token_ids] == [100, 101, 200, 201]
    (http,) = spans.get_finished_spans()
    (event,) = http.events
    assert event.name == "migration"
    assert dict(event.attributes) == {
        "migration.kind": "ongoing_request",
        "migration.failed_instance": "ab",
        "migration.tokens_generated": 2,
        "migration.retries_left": 1,
    }
