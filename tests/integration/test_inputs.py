"""The non-HTTP inputs: in=batch, in=stdin and the in=text REPL.

In-process tests drive the input functions with real pipelines and the echo engines; the CLI
tests run `dyngraph run` as a child process (the REPL through a pseudo-terminal, so Ctrl-C and
Ctrl-D reach it the way they do from a user's keyboard).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dynamo_graph.backend.protocol import LLMEngineOutput
from dynamo_graph.engines.echo import EchoFullEngine
from dynamo_graph.inputs.batch import run_batch
from dynamo_graph.inputs.stdin import run_stdin
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.llm.pipeline import ModelPipeline, TextPipeline
from dynamo_graph.process.launch import start_engine
from dynamo_graph.process.run_config import parse_run_config
from dynamo_graph.runtime.context import Context
from tests.support.processes import DYNGRAPH, run_cli

QUESTION = "What is the capital of Tuvalu?"
USER_HEADER = "<|start_header_id|>user<|end_header_id|>"
ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>"
TOO_LONG = "word " * 2000  # beyond the tiny model's 512-token context


def echo_full_pipeline(delay_s: float = 0.0) -> TextPipeline:
    card = ModelDeploymentCard.without_files("tiny")
    return TextPipeline(card, EchoFullEngine(delay_s=delay_s))


@pytest.fixture
async def echo_core_pipeline(tiny_model: Path) -> AsyncIterator[ModelPipeline]:
    """The real tokens pipeline `dyngraph run out=echo_core MODEL` builds."""
    started = await start_engine(parse_run_config(["out=echo_core", str(tiny_model)]))
    try:
        yield started.pipeline()
    finally:
        await started.engine.cleanup()


class FailingEngine:
    """An engine that breaks mid-answer, as a crashed worker would."""

    async def generate(self, request: AnyRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput(text="partial")
        yield LLMEngineOutput(finish_reason="error", error="worker lost")


class CountingEngine:
    """Echoes the prompt after a pause, recording how many requests ran at the same time."""

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0

    async def generate(self, request: AnyRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(0.002)
            yield LLMEngineOutput(text=str(request.messages[-1].content), finish_reason="stop")
        finally:
            self.active -= 1


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def read_output(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "output.jsonl").read_text().splitlines()]


# --- in=batch -------------------------------------------------------------------------------


async def test_batch_writes_every_answer_in_input_order(tmp_path: Path) -> None:
    prompts = [f"prompt number {i}" for i in range(100)]
    src = write_lines(tmp_path / "prompts.jsonl", [json.dumps({"text": p}) for p in prompts])

    assert await run_batch(echo_full_pipeline(), str(src)) == 0

    out = read_output(tmp_path)
    assert [r["text"] for r in out] == prompts
    for record, prompt in zip(out, prompts, strict=True):
        assert set(record) == {"text", "response", "tokens_in", "tokens_out", "elapsed_ms"}
        assert record["response"] == prompt
        # echo_full has no tokenizer: it counts characters.
        assert record["tokens_in"] == record["tokens_out"] == len(prompt)
        assert isinstance(record["elapsed_ms"], float) and record["elapsed_ms"] >= 0
    assert names(tmp_path) == ["output.jsonl", "prompts.jsonl"]  # no temp file


async def test_batch_keeps_input_order_when_answers_finish_out_of_order(tmp_path: Path) -> None:
    # Long prompts first: with a per-character delay the short ones finish long before them.
    prompts = ["x" * n for n in (40, 30, 20, 10, 1, 2, 3, 35, 5, 25)]
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": p}) for p in prompts])

    assert await run_batch(echo_full_pipeline(delay_s=0.002), str(src), concurrency=4) == 0

    assert [r["response"] for r in read_output(tmp_path)] == prompts


async def test_batch_runs_at_most_concurrency_requests_at_once(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": f"t{i}"}) for i in range(60)])
    engine = CountingEngine()
    card = ModelDeploymentCard.without_files("count")

    assert await run_batch(TextPipeline(card, engine), str(src), concurrency=5) == 0

    assert engine.peak == 5
    assert [r["response"] for r in read_output(tmp_path)] == [f"t{i}" for i in range(60)]


async def test_batch_reports_a_malformed_line_and_runs_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [json.dumps({"text": f"p{i}"}) for i in range(100)]
    lines[41] = '{"text": "unterminated'  # line 42
    src = write_lines(tmp_path / "in.jsonl", lines)

    assert await run_batch(echo_full_pipeline(), str(src)) == 1

    out = read_output(tmp_path)
    assert len(out) == 99
    assert "p41" not in [r["text"] for r in out]
    err = capsys.readouterr().err
    assert f"{src}:42: not valid JSON" in err
    assert "99 ok, 1 failed" in err


async def test_batch_names_each_kind_of_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = ['{"text": "good"}', "[1, 2]", '{"prompt": "x"}', '{"text": 7}', "not json", '{"text": "end"}']
    src = write_lines(tmp_path / "in.jsonl", lines)

    assert await run_batch(echo_full_pipeline(), str(src)) == 1

    assert [r["text"] for r in read_output(tmp_path)] == ["good", "end"]
    err = capsys.readouterr().err
    assert f"{src}:2: expected a JSON object" in err
    assert f'{src}:3: missing "text" string field' in err
    assert f'{src}:4: missing "text" string field' in err
    assert f"{src}:5: not valid JSON" in err


async def test_batch_skips_blank_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('\n{"text": "a"}\n   \n\n{"text": "b"}\n\t\n{"text": "c"}')  # no final newline

    assert await run_batch(echo_full_pipeline(), str(src)) == 0

    assert [r["response"] for r in read_output(tmp_path)] == ["a", "b", "c"]
    assert "3 ok, 0 failed" in capsys.readouterr().err


async def test_batch_reports_requests_the_pipeline_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], echo_core_pipeline: ModelPipeline
) -> None:
    lines = [json.dumps({"text": QUESTION}), json.dumps({"text": TOO_LONG}), json.dumps({"text": "Hi"})]
    src = write_lines(tmp_path / "in.jsonl", lines)

    assert await run_batch(echo_core_pipeline, str(src)) == 1

    out = read_output(tmp_path)
    assert [r["text"] for r in out] == [QUESTION, "Hi"]
    assert out[0]["tokens_in"] > 0 and out[0]["tokens_out"] > 0
    assert f"{src}:2: This model's maximum context length is 512 tokens" in capsys.readouterr().err


async def test_batch_reports_engine_failures_per_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    card = ModelDeploymentCard.without_files("broken")
    src = write_lines(tmp_path / "in.jsonl", ['{"text": "a"}', '{"text": "b"}'])

    assert await run_batch(TextPipeline(card, FailingEngine()), str(src)) == 1

    assert read_output(tmp_path) == []
    err = capsys.readouterr().err
    assert f"{src}:1: worker lost" in err and f"{src}:2: worker lost" in err


async def test_batch_replaces_a_previous_output_whole(tmp_path: Path) -> None:
    (tmp_path / "output.jsonl").write_text("stale\n")
    src = write_lines(tmp_path / "in.jsonl", ['{"text": "fresh"}'])

    assert await run_batch(echo_full_pipeline(), str(src)) == 0

    assert [r["text"] for r in read_output(tmp_path)] == ["fresh"]
    assert names(tmp_path) == ["in.jsonl", "output.jsonl"]


# --- in=stdin -------------------------------------------------------------------------------


async def test_stdin_prints_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run_stdin(echo_full_pipeline(), QUESTION + "\n", ignore_eos=True) == 0
    assert capsys.readouterr().out == QUESTION + "\n"


async def test_stdin_sends_the_templated_prompt(
    capsys: pytest.CaptureFixture[str], echo_core_pipeline: ModelPipeline
) -> None:
    assert await run_stdin(echo_core_pipeline, QUESTION + "\n", ignore_eos=True) == 0
    out = capsys.readouterr().out
    assert f"{USER_HEADER}\n\n{QUESTION}<|eot_id|>{ASSISTANT_HEADER}" in out
    assert out.endswith("\n")


async def test_stdin_empty_input_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run_stdin(echo_full_pipeline(), "\n", ignore_eos=False) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no prompt" in captured.err


async def test_stdin_rejected_request_exits_2(
    capsys: pytest.CaptureFixture[str], echo_core_pipeline: ModelPipeline
) -> None:
    assert await run_stdin(echo_core_pipeline, TOO_LONG, ignore_eos=True) == 2
    assert "maximum context length" in capsys.readouterr().err


async def test_stdin_engine_failure_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    card = ModelDeploymentCard.without_files("broken")
    assert await run_stdin(TextPipeline(card, FailingEngine()), QUESTION, ignore_eos=False) == 1
    captured = capsys.readouterr()
    assert captured.out == "partial\n"
    assert "worker lost" in captured.err


# --- the CLI ----------------------------------------------------------------------------------


def test_cli_piped_prompt_with_echo_full() -> None:
    proc = run_cli(["run", "out=echo_full", "--model-name", "tiny"], input_text=QUESTION + "\n", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == QUESTION + "\n"


def test_cli_piped_prompt_with_echo_core_shows_the_template(tiny_model: Path) -> None:
    proc = run_cli(["run", "out=echo_core", str(tiny_model)], input_text=QUESTION + "\n", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert USER_HEADER in proc.stdout
    assert QUESTION in proc.stdout


def test_cli_empty_piped_prompt_exits_2() -> None:
    proc = run_cli(["run", "out=echo_full", "--model-name", "tiny"], input_text="", timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""


def test_cli_batch_writes_output(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "prompts.jsonl", [json.dumps({"text": f"q{i}"}) for i in range(20)])
    proc = run_cli(["run", f"in=batch:{src}", "out=echo_full", "--model-name", "tiny"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [r["response"] for r in read_output(tmp_path)] == [f"q{i}" for i in range(20)]
    assert "20 ok, 0 failed" in proc.stderr


# --- in=text through a pseudo-terminal ----------------------------------------------------------

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
PROMPT = b"User \xc2\xb7 "  # "User · ", after the colour codes are stripped


class Terminal:
    """A child process on a pseudo-terminal that is its controlling tty, read with timeouts."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        argv = [*DYNGRAPH, *args]
        full_env = {**os.environ, "COLUMNS": "200", **env}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            try:
                os.execve(argv[0], argv, full_env)
            finally:
                os._exit(127)
        self.seen = b""

    def expect(self, marker: bytes, timeout: float = 30.0) -> str:
        """Everything up to and including `marker` (colours stripped), consumed."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError(f"waiting for {marker!r}; seen {self.seen!r}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                raise EOFError(f"waiting for {marker!r}; seen {self.seen!r}")
            self.seen = ANSI.sub(b"", self.seen + chunk)
        end = self.seen.index(marker) + len(marker)
        text, self.seen = self.seen[:end], self.seen[end:]
        return text.decode().replace("\r\n", "\n")

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with_status = os.waitpid(self.pid, os.WNOHANG)
            if with_status[0]:
                return os.waitstatus_to_exitcode(with_status[1])
            if select.select([self.fd], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):
                    self.seen += os.read(self.fd, 4096)
        raise TimeoutError(f"child still running; seen {self.seen!r}")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.fixture
def terminal() -> Iterator[list[Terminal]]:
    started: list[Terminal] = []
    yield started
    for term in started:
        term.close()


def open_terminal(started: list[Terminal], args: list[str], delay_ms: int = 0) -> Terminal:
    term = Terminal(["run", *args], {"DYN_TOKEN_ECHO_DELAY_MS": str(delay_ms)})
    started.append(term)
    return term


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_repl_answers_each_prompt_and_exits_on_ctrl_d(terminal: list[Terminal]) -> None:
    term = open_terminal(terminal, ["out=echo_full", "--model-name", "tiny"])
    term.expect(PROMPT)
    term.send(b"Hello there\n")
    assert term.expect(PROMPT) == "Hello there\nHello there\n✔ User · "
    term.send(QUESTION.encode() + b"\n")
    # echo_full answers with the last message of the conversation.
    assert term.expect(PROMPT) == f"{QUESTION}\n{QUESTION}\n✔ User · "
    term.send(b"\x04")
    assert term.wait() == 0


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_repl_sends_the_conversation_history(terminal: list[Terminal], tiny_model: Path) -> None:
    term = open_terminal(terminal, ["out=echo_core", str(tiny_model)])
    term.expect(PROMPT)
    term.send(b"First question\n")
    first = term.expect(PROMPT)
    assert f"{USER_HEADER}\n\nFirst question<|eot_id|>" in first
    term.send(b"Second question\n")
    second = term.expect(PROMPT).split("\n", 1)[1]  # after the terminal's echo of the typed line
    # The templated prompt of turn two holds turn one's question and answer, then the new one.
    assert second.index("First question") < second.index(ASSISTANT_HEADER) < second.index("Second question")
    term.send(b"\x04")
    assert term.wait() == 0


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_repl_ctrl_c_cancels_the_answer_then_quits_at_the_prompt(
    terminal: list[Terminal], tiny_model: Path
) -> None:
    term = open_terminal(terminal, ["out=echo_core", str(tiny_model)], delay_ms=200)
    term.expect(PROMPT)
    term.send(b"Forget this one\n")
    term.expect(USER_HEADER.encode())  # the answer has started streaming
    term.send(b"\x03")
    cancelled = term.expect(PROMPT, timeout=10)
    assert "[cancelled]" in cancelled
    assert "Forget this one" not in cancelled  # cut short before the echo reached the question
    term.send(b"Keep this\n")
    kept = term.expect(PROMPT, timeout=60)
    assert "Keep this" in kept and "Forget this one" not in kept  # the cancelled turn is not history
    term.send(b"\x03")
    assert term.wait() == 0


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_repl_reports_a_rejected_request_and_goes_on(terminal: list[Terminal], tiny_model: Path) -> None:
    term = open_terminal(terminal, ["out=echo_core", str(tiny_model)])
    term.expect(PROMPT)
    term.send(b"word " * 700 + b"\n")  # under the terminal's 4 KiB line limit, over 512 tokens
    assert "maximum context length is 512 tokens" in term.expect(PROMPT)
    term.send(b"Still here?\n")
    answer = term.expect(PROMPT).split("\n", 1)[1]
    assert "Still here?" in answer and "word word" not in answer  # the rejected turn is not history
    term.send(b"\x04")
    assert term.wait() == 0
