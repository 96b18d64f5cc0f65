"""Engines written in one Python file, as dynamo-run runs them (`out=pystr:FILE`, `out=pytok:FILE`),
and files that define an `LLMEngine` class (`out=FILE.py`, what a graph's `engine: x.py` compiles
to). The file's `generate` runs in a task of its own, so cancellation never waits for it and its
errors never take the worker down. What a file must look like: docs/custom-engines.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import logging
import runpy
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo_graph.backend.engine import (
    WIRE_FINISH_REASONS,
    EngineConfig,
    LLMEngine,
    ModelInput,
    normalize_finish_reason,
)
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.llm.openai import AnyRequest, ChatCompletionRequest, requested_max_tokens
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

log = logging.getLogger(__name__)

# out=KIND:FILE -> the model input the file's engine takes.
FILE_ENGINE_KINDS: dict[str, ModelInput] = {"pystr": "text", "pytok": "tokens"}
_ARGV_LOCK = threading.Lock()


class PythonEngineError(RunConfigError):
    """A python engine file that cannot be used (missing, does not compile, no `generate`...)."""


def split_file_engine(output: str) -> tuple[str, Path]:
    """`pystr:FILE` / `pytok:FILE` -> (kind, path)."""
    kind, sep, path = output.partition(":")
    if not sep or kind not in FILE_ENGINE_KINDS:
        raise PythonEngineError(f"{output!r} is not out=pystr:FILE or out=pytok:FILE")
    if not path:
        raise PythonEngineError(f"out={kind}:FILE needs a python file, e.g. out={kind}:my_engine.py")
    return kind, Path(path).expanduser()


def file_argv(path: Path, cfg: EngineSettings | None, model: LocalModel | None = None) -> list[str]:
    """The `sys.argv` a python engine file sees, as dynamo-run builds it."""
    argv = [str(path)]
    if cfg is None:
        return argv
    if cfg.model_path:
        argv += ["--model-path", cfg.model_path]
    name = cfg.model_name or (model.display_name if model is not None else None)
    if name:
        argv += ["--model-name", name]
    argv += [
        "--http-port",
        str(cfg.http_port),
        "--tensor-parallel-size",
        str(cfg.tensor_parallel_size),
        "--base-gpu-id",
        str(cfg.base_gpu_id),
        "--num-nodes",
        str(cfg.num_nodes),
        "--node-rank",
        str(cfg.node_rank),
    ]
    if cfg.leader_addr:
        argv += ["--leader-addr", cfg.leader_addr]
    if cfg.model_config:
        argv += ["--model-config", cfg.model_config]
    return argv + list(cfg.engine_argv)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _load_error(path: Path, err: BaseException) -> PythonEngineError:
    if isinstance(err, SyntaxError):
        where = f"{err.filename or path}:{err.lineno}" if err.lineno else str(path)
        return PythonEngineError(f"python engine {where}: {type(err).__name__}: {err.msg}")
    if isinstance(err, SystemExit):
        return PythonEngineError(f"python engine {path} exited (code {err.code}) while loading")
    frames = [f for f in _traceback_frames(err) if Path(f[0]).resolve() == path.resolve()]
    where = f"{path}:{frames[-1][1]}" if frames else str(path)
    return PythonEngineError(f"python engine {where} failed while loading: {_describe(err)}")


def _traceback_frames(err: BaseException) -> list[tuple[str, int]]:
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _run_file(path: Path, argv: list[str]) -> dict[str, Any]:
    """Run the file as `__main__` with `argv` as sys.argv (dynamo-run's way); its globals."""
    if not path.is_file():
        raise PythonEngineError(f"python engine file {path} does not exist")
    folder = str(path.resolve().parent)
    with _ARGV_LOCK:
        saved = sys.argv
        sys.argv = list(argv)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            return runpy.run_path(str(path), run_name="__main__")
        except PythonEngineError:
            raise
        except BaseException as err:  # SystemExit from an argparse in the file's main, too
            if isinstance(err, KeyboardInterrupt):
                raise
            log.debug("loading %s failed", path, exc_info=err)
            raise _load_error(path, err) from None
        finally:
            sys.argv = saved


def _generate_function(path: Path, namespace: Mapping[str, Any]) -> tuple[Callable[..., Any], bool]:
    """The file's `generate` and whether it takes the request's context."""
    fn = namespace.get("generate")
    hint = "a python engine file needs `async def generate(request):` that yields chunks"
    if fn is None:
        raise PythonEngineError(f"python engine {path} defines no `generate`: {hint}")
    if not callable(fn):
        raise PythonEngineError(f"python engine {path}: `generate` is a {type(fn).__name__}: {hint}")
    if inspect.isgeneratorfunction(fn):
        raise PythonEngineError(f"python engine {path}: `generate` is a plain generator (def): {hint}")
    if inspect.iscoroutinefunction(fn):
        raise PythonEngineError(
            f"python engine {path}: `generate` is a coroutine (async def without yield): {hint}"
        )
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn, False
    return fn, "context" in params


def _full_dict(obj: Any) -> Any:
    """A Struct as a dict with every field (None where unset), as dynamo-run passes requests."""
    if isinstance(obj, msgspec.Struct):
        return {f: _full_dict(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list):
        return [_full_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _full_dict(v) for k, v in obj.items()}
    return obj


# Chunks the file's generator may run ahead of the consumer (it waits beyond: back-pressure, and
# a generator that never awaits still lets the event loop run).
STREAM_BUFFER = 64


class _Stream:
    """One request's run of the file's generator, consumed by a task of its own."""

    __slots__ = ("cancelled", "pump", "queue", "watcher")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(STREAM_BUFFER)
        self.pump: asyncio.Task[None] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.cancelled = False

    async def run(self, agen: Any) -> None:
        queue = self.queue
        try:
            async for item in agen:
                await queue.put(("item", item))
            await queue.put(("end", None))
        except asyncio.CancelledError:
            # The consumer checks `cancelled` after every chunk; when it waits on an empty
            # queue this wakes it.
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(("cancelled", None))
        except Exception as err:
            await queue.put(("error", err))
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()

    async def watch(self, context: Context) -> None:
        await context.stopped()
        self.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()

    async def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()
        for task in (self.pump, self.watcher):
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task


class PythonFileEngine(LLMEngine):
    """`out=pystr:FILE` (model_input "text") or `out=pytok:FILE` ("tokens"); see the module doc."""

    def __init__(
        self,
        path: str | Path,
        *,
        model_input: ModelInput,
        argv: list[str] | None = None,
        served_model_name: str | None = None,
        context_length: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.model_input: ModelInput = model_input
        self.argv = argv if argv is not None else [str(self.path)]
        self.served_model_name = served_model_name or self.path.stem
        self.context_length = context_length
        self.kind = "pystr" if model_input == "text" else "pytok"
        self._generate: Callable[..., Any] | None = None
        self._wants_context = False
        self._streams: dict[Context, _Stream] = {}
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> PythonFileEngine:
        kind, path = split_file_engine(cfg.engine or "")
        if not path.is_file():
            raise PythonEngineError(f"out={kind}:{path}: no such file")
        return cls(
            path,
            model_input=FILE_ENGINE_KINDS[kind],
            argv=file_argv(path, cfg, model),
            served_model_name=cfg.model_name or (model.display_name if model is not None else None),
            context_length=cfg.context_length,
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    def config(self) -> EngineConfig:
        return EngineConfig(
            model_input=self.model_input,
            served_model_name=self.served_model_name,
            context_length=self.context_length,
            # dynamo-run's pystr engines take chat requests only.
            model_type=["chat"] if self.model_input == "text" else None,
        )

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown(f"python engine {self.path} was shut down")
        if self._generate is None:
            # In a thread: loading may import heavy packages, and the runtime's lease keepalive
            # shares this event loop.
            namespace = await asyncio.to_thread(_run_file, self.path, self.argv)
            generate, wants_context = _generate_function(self.path, namespace)
            initialize = namespace.get("initialize")
            if callable(initialize):
                try:
                    result = initialize(list(self.argv))
                    if inspect.isawaitable(result):
                        await result
                except Exception as err:
                    log.debug("initialize of %s failed", self.path, exc_info=err)
                    raise PythonEngineError(
                        f"python engine {self.path}: initialize(argv) failed: {_describe(err)}"
                    ) from None
            self._generate, self._wants_context = generate, wants_context
            log.info("python engine %s loaded (%s)", self.path, self.kind)
        return self.config()

    async def abort(self, context: Context) -> None:
        stream = self._streams.get(context)
        if stream is not None:
            stream.cancel()

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        streams = list(self._streams.values())
        for stream in streams:
            await stream.close()

    # ---- requests ----------------------------------------------------------------------------

    def _request_dict(self, request: PreprocessedRequest | AnyRequest) -> tuple[dict[str, Any], int | None]:
        if self.model_input == "tokens":
            if not isinstance(request, PreprocessedRequest):
                raise InvalidArgument(
                    f"python engine {self.path.name} (pytok) takes pre-processed requests", param="model"
                )
            return _full_dict(request), request.stop_conditions.max_tokens
        if isinstance(request, PreprocessedRequest):
            raise InvalidArgument(
                f"python engine {self.path.name} (pystr) takes OpenAI requests", param="model"
            )
        if not isinstance(request, ChatCompletionRequest):
            raise InvalidArgument(
                f"python engine {self.path.name} (pystr) serves chat completions only: "
                "use /v1/chat/completions",
                param="prompt",
            )
        return msgspec.to_builtins(request), requested_max_tokens(request)

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if self._closed:
            raise EngineShutdown(f"python engine {self.path.name} shut down")
        if self._generate is None:
            raise EngineError(f"python engine {self.path.name} is not started")
        payload, limit = self._request_dict(request)
        prompt_tokens = len(request.token_ids) if isinstance(request, PreprocessedRequest) else 0
        counter = _Counter(prompt_tokens)
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=counter.usage())
            return
        try:
            if self._wants_context:
                agen = self._generate(payload, context=context)
            else:
                agen = self._generate(payload)
        except EngineError:
            raise
        except Exception as err:
            yield self._failure(f"generate(request) raised {_describe(err)}", err)
            return
        if not hasattr(agen, "__aiter__"):
            if inspect.iscoroutine(agen):
                agen.close()
            yield self._failure(f"generate(request) returned {type(agen).__name__}, not an async generator")
            return
        stream = _Stream()
        loop = asyncio.get_running_loop()
        stream.pump = loop.create_task(stream.run(agen.__aiter__()))
        stream.watcher = loop.create_task(stream.watch(context))
        self._streams[context] = stream
        try:
            while True:
                kind, value = await stream.queue.get()
                if stream.cancelled and kind != "error":
                    kind = "cancelled"
                if kind == "item":
                    out = self._convert(value, counter, limit)
                    yield out
                    if out.finish_reason is not None:
                        return
                elif kind == "end":
                    yield LLMEngineOutput(finish_reason="stop", completion_usage=counter.usage())
                    return
                elif kind == "cancelled":
                    yield LLMEngineOutput(finish_reason="cancelled", completion_usage=counter.usage())
                    return
                else:
                    if isinstance(value, EngineError):
                        raise value
                    yield self._failure(f"generate raised {_describe(value)}", value)
                    return
        finally:
            if self._streams.get(context) is stream:
                del self._streams[context]
            await stream.close()

    def _failure(self, what: str, err: BaseException | None = None) -> LLMEngineOutput:
        message = f"python engine {self.path.name}: {what}"
        if err is not None:
            log.error("%s", message, exc_info=err)
        else:
            log.error("%s", message)
        return LLMEngineOutput(finish_reason="error", error=message)

    def _convert(self, item: Any, counter: _Counter, limit: int | None) -> LLMEngineOutput:
        if not isinstance(item, Mapping):
            shape = "{'token_ids': [...]}" if self.model_input == "tokens" else "a chat.completion.chunk dict"
            return self._failure(f"generate yielded {type(item).__name__} ({item!r:.80}); expected {shape}")
        try:
            out = self._token_chunk(item) if self.model_input == "tokens" else self._text_chunk(item, counter)
        except (msgspec.ValidationError, TypeError, ValueError) as err:
            return self._failure(f"generate yielded a chunk of the wrong shape: {err}")
        if self.model_input == "tokens":
            if limit is not None and counter.completion + len(out.token_ids) >= limit:
                out.token_ids = out.token_ids[: limit - counter.completion]
                out.finish_reason = out.finish_reason or "length"
            counter.completion += len(out.token_ids)
        elif out.text:
            counter.completion += 1
            if limit is not None and counter.completion >= limit and out.finish_reason is None:
                out.finish_reason = "length"
        if out.finish_reason is not None and out.completion_usage is None:
            out.completion_usage = counter.usage()
        return out

    @staticmethod
    def _token_chunk(item: Mapping[str, Any]) -> LLMEngineOutput:
        fields = {k: v for k, v in item.items() if v is not None}
        reason = fields.pop("finish_reason", None)
        if "token_ids" not in fields:
            raise ValueError("a pytok chunk needs `token_ids` (a list of ints)")
        fields.pop("completion_usage", None)
        out = msgspec.convert(fields, LLMEngineOutput)
        out.finish_reason = _finish(reason)
        return out

    @staticmethod
    def _text_chunk(item: Mapping[str, Any], counter: _Counter) -> LLMEngineOutput:
        choices = item.get("choices") or [{}]
        choice = choices[0]
        if not isinstance(choice, Mapping):
            raise ValueError("`choices[0]` must be an object")
        delta = choice.get("delta") or choice.get("message") or {}
        if not isinstance(delta, Mapping):
            raise ValueError("`choices[0].delta` must be an object")
        text = delta.get("content")
        if text is None:
            text = choice.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"`delta.content` must be a string, not {type(text).__name__}")
        out = LLMEngineOutput(text=text or None, finish_reason=_finish(choice.get("finish_reason")))
        usage = item.get("usage")
        if isinstance(usage, Mapping):
            details = usage.get("prompt_tokens_details") or {}
            counter.reported = CompletionUsage(
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                cached_tokens=details.get("cached_tokens") if isinstance(details, Mapping) else None,
            )
            out.completion_usage = counter.reported
        return out


def _finish(reason: Any) -> Any:
    if reason is None:
        return None
    reason = str(reason)
    return reason if reason in WIRE_FINISH_REASONS else normalize_finish_reason(reason)


class _Counter:
    __slots__ = ("completion", "prompt", "reported")

    def __init__(self, prompt: int) -> None:
        self.prompt = prompt
        self.completion = 0
        self.reported: CompletionUsage | None = None

    def usage(self) -> CompletionUsage:
        if self.reported is not None:
            return self.reported
        return CompletionUsage(prompt_tokens=self.prompt, completion_tokens=self.completion)


# ---- out=FILE.py: a file that defines an LLMEngine class ------------------------------------------


def load_engine_class(path: str | Path) -> type[LLMEngine]:
    """Import FILE (not as __main__, so its `run(MyEngine)` does not fire) and return its engine:
    the module's `ENGINE` if set, else the one LLMEngine subclass it defines."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise PythonEngineError(f"engine file {path} does not exist")
    name = "_dyngraph_engine_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise PythonEngineError(f"engine file {path} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as err:
            del sys.modules[name]
            if isinstance(err, KeyboardInterrupt):
                raise
            raise _load_error(path, err) from None
    chosen = getattr(module, "ENGINE", None)
    if chosen is not None:
        if not (isinstance(chosen, type) and issubclass(chosen, LLMEngine)):
            raise PythonEngineError(f"engine file {path}: ENGINE must be an LLMEngine subclass")
        return chosen
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, LLMEngine)
        and obj.__module__ == name
        and not inspect.isabstract(obj)
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        hint = (
            "; it defines generate(): run it as out=pystr:FILE (OpenAI chat in/out) "
            "or out=pytok:FILE (tokens)"
            if callable(getattr(module, "generate", None))
            else ""
        )
        raise PythonEngineError(f"engine file {path} defines no LLMEngine subclass{hint}")
    names = ", ".join(sorted(c.__name__ for c in found))
    raise PythonEngineError(f"engine file {path} defines several engines ({names}): set ENGINE = TheOne")


def create_file_engine(output: str, cfg: EngineSettings, model: LocalModel | None) -> LLMEngine:
    """The engine of `out=pystr:FILE`, `out=pytok:FILE` or `out=FILE.py`."""
    kind, sep, _ = output.partition(":")
    if sep and kind in FILE_ENGINE_KINDS:
        settings = cfg if cfg.engine == output else replace(cfg, engine=output)
        return PythonFileEngine.from_config(settings, model)
    return load_engine_class(output).from_config(cfg, model)
