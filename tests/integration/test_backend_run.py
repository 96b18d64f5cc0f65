"""`dynamo_graph.backend.run`: a custom LLMEngine served as a worker, sharing the serving code of
`dyngraph run in=dyn://...`; the worker handlers' finish-reason normalisation, error frames and
cancellation monitoring; and examples/custom_engine.py behind an `out=auto` frontend."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from dynamo_graph.backend.command_line import parse_worker_args
from dynamo_graph.backend.conformance import check_engine
from dynamo_graph.backend.engine import EngineConfig, LLMEngine, normalize_finish_reason
from dynamo_graph.backend.errors import EngineError
from dynamo_graph.backend.handlers import InflightCap, tokens_handler
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest, StopConditions
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.runtime.context import Context
from tests.support.processes import ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.waiting import wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_engine.py"


# ---- the command line ---------------------------------------------------------------------------


def test_worker_args_take_dynamo_run_flags_and_engine_args() -> None:
    worker = parse_worker_args(
        ["in=dyn://ns.comp", "/models/m", "--migration-limit", "2", "--", "--delay-ms", "5"]
    )
    assert worker.endpoint == "dyn://ns.comp.generate"
    assert worker.engine.model_path == "/models/m" and worker.worker.migration_limit == 2
    assert list(worker.engine_args) == ["--delay-ms", "5"] == worker.engine.engine_argv
    assert parse_worker_args(["--endpoint", "dyn://a.b.c"]).endpoint == "dyn://a.b.c"
    assert parse_worker_args([]).endpoint == "dyn://dynamo.backend.generate"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--no-such-flag"], "'--no-such-flag'"),
        (["out=mocker"], "serves its own engine"),
        (["in=http"], "a worker serves a dyn:// endpoint"),
        (["--endpoint", "dyn://a..b"], "dyn://a..b"),
        (["--migration-limit", "-1"], "--migration-limit must be at least 0"),
    ],
)
def test_worker_args_errors(argv: list[str], says: str) -> None:
    with pytest.raises(RunConfigError, match=None) as err:
        parse_worker_args(argv)
    assert says in str(err.value)


def test_finish_reasons_are_normalised() -> None:
    cases = {"eos": "stop", "abort": "cancelled", "max_tokens": "length", "error": "error", "odd": "stop"}
    assert {k: normalize_finish_reason(k) for k in cases} == cases


# ---- the worker's handler -----------------------------------------------------------------------


class _Scripted(LLMEngine):
    def __init__(self, script: list[LLMEngineOutput], hang: bool = False) -> None:
        self.script = script
        self.hang = hang
        self.aborted: list[str] = []

    async def start(self, worker_id: int = 0) -> EngineConfig:
        return EngineConfig()

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        for out in self.script:
            yield out
        if self.hang:
            await asyncio.sleep(3600)

    async def abort(self, context: Context) -> None:
        self.aborted.append(context.id)

    async def cleanup(self) -> None:
        return None


REQUEST = PreprocessedRequest(model="m", token_ids=[1], stop_conditions=StopConditions(max_tokens=4))


async def test_handler_normalises_and_ends_at_the_final_chunk() -> None:
    engine = _Scripted(
        [
            LLMEngineOutput(token_ids=[5]),
            LLMEngineOutput(finish_reason="abort"),  # type: ignore[arg-type]
            LLMEngineOutput(token_ids=[6]),
        ]
    )
    cap = InflightCap()
    outs = [o async for o in tokens_handler(engine, cap=cap)(REQUEST, Context())]
    assert [o.finish_reason for o in outs] == [None, "cancelled"]
    assert (cap.served, cap.failed, cap.cancelled, cap.inflight) == (1, 0, 0, 0)  # the worker's /metrics


async def test_handler_turns_an_error_chunk_into_an_error() -> None:
    engine = _Scripted([LLMEngineOutput(finish_reason="error", error="cuda fell over")])
    cap = InflightCap()
    with pytest.raises(EngineError, match="cuda fell over"):
        _ = [o async for o in tokens_handler(engine, cap=cap)(REQUEST, Context())]
    assert (cap.served, cap.failed, cap.cancelled) == (0, 1, 0)


async def test_a_stopped_context_reaches_abort_at_once() -> None:
    engine = _Scripted([LLMEngineOutput(token_ids=[5])], hang=True)
    context = Context("r1")
    cap = InflightCap()
    stream = tokens_handler(engine, cap=cap)(REQUEST, context)
    assert (await anext(stream)).token_ids == [5]
    pending = asyncio.ensure_future(anext(stream))  # the engine now hangs
    await asyncio.sleep(0.01)
    context.stop_generating()
    await asyncio.sleep(0.01)
    assert engine.aborted == ["r1"]  # while the engine still hangs
    pending.cancel()
    with pytest.raises(BaseException):  # noqa: B017 - CancelledError or StopAsyncIteration
        await pending
    await stream.aclose()
    assert engine.aborted == ["r1"]  # exactly once
    assert (cap.served, cap.failed, cap.cancelled, cap.inflight) == (0, 0, 1, 0)


async def test_custom_engine_example_conforms() -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from custom_engine import ReverseEngine  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLE.parent))

    def request(max_tokens: int) -> PreprocessedRequest:
        ids = list(range(10, 10 + max_tokens + 4))
        stop = StopConditions(max_tokens=max_tokens)
        return PreprocessedRequest(model="m", token_ids=ids, stop_conditions=stop)

    await check_engine(lambda: ReverseEngine(delay_s=0.002), request)


# ---- a worker process behind an out=auto frontend -----------------------------------------------


@pytest.fixture
def planes(tmp_path: Path) -> dict[str, str]:
    return embedded_planes_env(tmp_path)


@pytest.fixture
def frontend(tmp_path: Path, planes: dict[str, str]) -> Iterator[ServerProcess]:
    # A model whose workers left stays listed for --model-wait-s: 1 s here, so it leaves soon.
    proc = ServerProcess(["out=auto", "--model-wait-s", "1"], env=planes, log_dir=tmp_path)
    try:
        proc.wait_ready(path="/live")
        yield proc
    finally:
        proc.stop()


def _models(base_url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{base_url}/v1/models", timeout=5).json()["data"]]


def test_custom_engine_worker_behind_a_frontend(
    frontend: ServerProcess, tiny_model: Path, planes: dict[str, str], tmp_path: Path
) -> None:
    openai = pytest.importorskip("openai")
    worker = WorkerProcess(
        [
            sys.executable,
            str(EXAMPLE),
            "in=dyn://custom.backend.generate",
            "--model-path",
            str(tiny_model),
            "--model-name",
            "reverse",
            "--",
            "--max-prompt-tokens",
            "64",
        ],
        env=planes,
        log_dir=tmp_path,
    )
    try:
        wait_for(
            lambda: "reverse" in _models(frontend.base_url), 30, f"the worker to register:\n{worker.log()}"
        )
        client = openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="reverse", messages=[{"role": "user", "content": "abc"}], max_tokens=100
        )
        # The engine ends with "eos": normalised to "stop" on the worker.
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model="reverse", messages=[{"role": "user", "content": "abc"}], max_tokens=2, stream=True
        )
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
        # The engine's InvalidArgument is the client's 400, with the engine's message.
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="reverse", messages=[{"role": "user", "content": "x " * 200}]
            )
        assert "this engine takes at most 64" in str(err.value)
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(timeout=15) == 0, worker.log()
        wait_for(lambda: "reverse" not in _models(frontend.base_url), 10, "the model to leave")
    finally:
        worker.stop()


def test_a_bad_worker_command_line_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--bogus"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "'--bogus'" in result.stderr


async def test_health_check_payload_runs_through_the_engine() -> None:
    from dynamo_graph.backend.handlers import run_health_check
    from dynamo_graph.engines.echo import EchoCoreEngine, EchoFullEngine

    for engine in (EchoCoreEngine(delay_s=0), EchoFullEngine(delay_s=0)):
        config = await engine.start()
        payload = engine.health_check_request(config)
        assert payload is not None
        await run_health_check(engine, config, payload)
    broken = _Scripted([LLMEngineOutput(finish_reason="error", error="no device")])
    config = await broken.start()
    with pytest.raises(EngineError, match="health check failed: no device"):
        await run_health_check(broken, config, broken.health_check_request(config) or {})
