"""Python engine files (`out=pystr:FILE`, `out=pytok:FILE`, `out=FILE.py`): loading, their errors,
the conformance kit, and the whole `dyngraph run in=http` stack with the official openai client."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_graph.backend.conformance import check_engine
from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import PreprocessedRequest, StopConditions
from dynamo_graph.backend.settings import EngineSettings
from dynamo_graph.engines import create_engine, get_engine_spec
from dynamo_graph.engines.pyfile import PythonEngineError, PythonFileEngine
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.runtime.context import Context
from tests.support.processes import ServerProcess, run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

PYTOK = """
import asyncio

async def generate(request):
    for i in range(request["stop_conditions"]["max_tokens"] or 16):
        await asyncio.sleep(0.001)
        yield {"token_ids": [100 + i]}
    yield {"token_ids": [], "finish_reason": "eos"}
"""

PYSTR = """
import asyncio

async def generate(request, context=None):
    for i in range(request.get("max_tokens") or 16):
        await asyncio.sleep(0.001)
        yield {"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
    yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
"""


def write(tmp_path: Path, source: str, name: str = "engine.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def token_request(max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="m", token_ids=[1, 2, 3], stop_conditions=StopConditions(max_tokens=max_tokens)
    )


def chat_request(max_tokens: int = 8, **extra: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}
    return msgspec.convert(body, ChatCompletionRequest)


async def collect(engine: PythonFileEngine, request: Any) -> list[Any]:
    return [out async for out in engine.generate(request, Context())]


# ---- the conformance kit ----------------------------------------------------------------------


async def test_pytok_file_conforms(tmp_path: Path) -> None:
    path = write(tmp_path, PYTOK)
    await check_engine(lambda: PythonFileEngine(path, model_input="tokens"), token_request)


async def test_pystr_file_conforms(tmp_path: Path) -> None:
    path = write(tmp_path, PYSTR)
    await check_engine(lambda: PythonFileEngine(path, model_input="text"), chat_request)


async def test_example_pytok_file_conforms() -> None:
    path = EXAMPLES / "pytok_engine.py"
    await check_engine(lambda: PythonFileEngine(path, model_input="tokens"), token_request)


# ---- semantics ----------------------------------------------------------------------------------


async def test_file_runs_as_main_with_dynamo_run_argv_and_initialize(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        import sys
        SEEN = {}
        if __name__ == "__main__":
            SEEN["main_argv"] = list(sys.argv)

        def initialize(argv):
            SEEN["init_argv"] = argv

        async def generate(request):
            yield {"token_ids": [len(SEEN["main_argv"]), len(SEEN["init_argv"])], "finish_reason": "stop"}
        """,
    )
    cfg = EngineSettings(engine=f"pytok:{path}", model_name="m", http_port=9001, engine_argv=["-n", "1"])
    engine = create_engine(cfg.engine, cfg, None)
    assert isinstance(engine, PythonFileEngine)
    assert engine.argv == [
        str(path),
        "--model-name", "m", "--http-port", "9001", "--tensor-parallel-size", "1", "--base-gpu-id", "0",
        "--num-nodes", "1", "--node-rank", "0", "-n", "1",
    ]  # fmt: skip
    config = await engine.start()
    assert config.model_input == "tokens" and config.served_model_name == "m"
    outs = await collect(engine, token_request(4))
    assert outs[0].token_ids == [len(engine.argv), len(engine.argv)]
    await engine.cleanup()


async def test_max_tokens_is_enforced_and_usage_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        async def generate(request):
            while True:
                yield {"token_ids": [7, 8, 9]}
        """,
    )
    engine = PythonFileEngine(path, model_input="tokens")
    await engine.start()
    outs = await collect(engine, token_request(5))
    assert [t for o in outs for t in o.token_ids] == [7, 8, 9, 7, 8]
    assert outs[-1].finish_reason == "length"
    assert outs[-1].completion_usage.completion_tokens == 5
    await engine.cleanup()


async def test_pystr_usage_and_chat_only(tmp_path: Path) -> None:
    engine = PythonFileEngine(write(tmp_path, PYSTR), model_input="text")
    config = await engine.start()
    assert config.model_input == "text" and config.model_type == ["chat"]
    outs = await collect(engine, chat_request(3))
    assert "".join(o.text or "" for o in outs) == "w0 w1 w2 "
    assert outs[-1].finish_reason == "length" and outs[-1].completion_usage.completion_tokens == 3
    await engine.cleanup()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def oops(:\n    pass\n", "engine.py:1: SyntaxError"),
        ("x = 1\n", "defines no `generate`"),
        ("def generate(request):\n    yield {}\n", "plain generator"),
        ("async def generate(request):\n    return {}\n", "coroutine (async def without yield)"),
        ("generate = 3\n", "`generate` is a int"),
        ("raise RuntimeError('no GPU')\n", "engine.py:1 failed while loading: RuntimeError: no GPU"),
        ("import sys\nsys.exit(3)\n", "exited (code 3) while loading"),
        (
            "def initialize(argv):\n    raise ValueError('bad flag')\nasync def generate(r):\n    yield {}\n",
            "initialize(argv) failed: ValueError: bad flag",
        ),
    ],
)
async def test_file_errors_are_clear(tmp_path: Path, source: str, message: str) -> None:
    engine = PythonFileEngine(write(tmp_path, source), model_input="tokens")
    with pytest.raises(PythonEngineError) as err:
        await engine.start()
    assert message in str(err.value)
    await engine.cleanup()


def test_missing_file_and_missing_path() -> None:
    with pytest.raises(PythonEngineError, match="no such file"):
        create_engine(
            "pystr:/nonexistent/engine.py", EngineSettings(engine="pystr:/nonexistent/engine.py"), None
        )
    with pytest.raises(Exception, match=r"out=pytok needs a python file: out=pytok:FILE"):
        get_engine_spec("pytok")
    assert get_engine_spec("pytok:x.py").needs_model and not get_engine_spec("pystr:x.py").needs_model


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("raise ValueError('boom')", "generate raised ValueError: boom"),
        ("yield 42", "generate yielded int (42)"),
        ("yield {'token_ids': 'abc'}", "wrong shape"),
        ("yield {'text': 'no ids'}", "needs `token_ids`"),
    ],
)
async def test_errors_mid_stream_end_the_request_not_the_engine(tmp_path: Path, body: str, says: str) -> None:
    source = f"async def generate(request):\n    yield {{'token_ids': [1]}}\n    {body}\n"
    engine = PythonFileEngine(write(tmp_path, source), model_input="tokens")
    await engine.start()
    outs = await collect(engine, token_request(8))
    assert outs[-1].finish_reason == "error" and says in (outs[-1].error or "")
    outs = await collect(engine, token_request(8))  # the engine still serves
    assert outs[0].token_ids == [1]
    await engine.cleanup()


async def test_typed_errors_keep_their_type(tmp_path: Path) -> None:
    source = """
    from dynamo_graph.backend.errors import InvalidArgument

    async def generate(request):
        raise InvalidArgument("temperature too hot", param="temperature")
        yield
    """
    engine = PythonFileEngine(write(tmp_path, source), model_input="tokens")
    await engine.start()
    with pytest.raises(InvalidArgument, match="temperature too hot"):
        await collect(engine, token_request(8))
    await engine.cleanup()


async def test_out_file_py_loads_an_engine_class() -> None:
    cfg = EngineSettings(engine=str(EXAMPLES / "custom_engine.py"), engine_argv=["--max-prompt-tokens", "2"])
    engine = create_engine(cfg.engine, cfg, None)
    assert type(engine).__name__ == "ReverseEngine"
    await engine.start()
    with pytest.raises(InvalidArgument, match="at most 2"):
        await collect(engine, token_request(8))  # type: ignore[arg-type]
    await engine.cleanup()


async def test_out_file_py_without_an_engine_class_suggests_pystr(tmp_path: Path) -> None:
    path = write(tmp_path, PYSTR, "plain.py")
    with pytest.raises(PythonEngineError, match="out=pystr:FILE"):
        create_engine(str(path), EngineSettings(engine=str(path)), None)


# ---- the whole stack ---------------------------------------------------------------------------


@pytest.fixture
def pytok_server(tiny_model: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        [f"out=pytok:{EXAMPLES / 'pytok_engine.py'}", "--model-path", str(tiny_model), "--model-name", "tok"],
        log_dir=tmp_path,
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_pytok_through_http_with_the_openai_client(pytok_server: ServerProcess) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{pytok_server.base_url}/v1", api_key="none")
    messages = [{"role": "user", "content": "hello brown fox"}]
    reply = client.chat.completions.create(model="tok", messages=messages, max_tokens=32)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and "fox" in text
    assert reply.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tok", messages=messages, max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_pystr_through_http(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    proc = ServerProcess(
        [f"out=pystr:{EXAMPLES / 'pystr_engine.py'}", "--model-name", "shout"], log_dir=tmp_path
    )
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="shout", messages=[{"role": "user", "content": "make some noise"}]
        )
        assert reply.choices[0].message.content == "MAKE SOME NOISE"
        assert reply.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError, match="serves chat"):  # a pystr engine serves chat only
            client.completions.create(model="shout", prompt="hi")
    finally:
        proc.stop()


def test_a_broken_file_fails_the_command_with_a_clear_message(tmp_path: Path) -> None:
    path = write(tmp_path, "async def generate(request):\n    yield {\n")
    result = run_cli(["run", "in=none", f"out=pystr:{path}"], timeout=60)
    assert result.returncode == 2, result.stderr
    assert "engine.py:2" in result.stderr and "SyntaxError" in result.stderr
