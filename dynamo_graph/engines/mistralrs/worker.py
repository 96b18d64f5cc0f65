"""The one thread that owns mistral.rs's `Runner` (it is not re-entrant): every Runner call and
every read of a response stream happens there; running streams are read round-robin, one chunk
each per round, so mistral.rs batches them; chunks reach the event loop through
`call_soon_threadsafe` (docs/engines/mistralrs.md, "Threads")."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from dynamo_graph.backend.errors import EngineError, EngineShutdown
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest, TopLogprob
from dynamo_graph.engines.mistralrs.args import MistralrsArgs, import_mistralrs, sampling_fields
from dynamo_graph.engines.mistralrs.vocab import TokenBytes
from dynamo_graph.engines.sampling import stop_token_ids
from dynamo_graph.runtime.context import Context

log = logging.getLogger(__name__)

# mistral.rs finish reasons -> ours.
_FINISH = {"stop": "stop", "length": "length", "canceled": "cancelled", "cancelled": "cancelled"}


class Job:
    """One request as the worker thread sees it; results go to `out` on the event loop."""

    __slots__ = (
        "cancelled",
        "context",
        "count",
        "loop",
        "max_tokens",
        "min_tokens",
        "out",
        "prompt_ids",
        "request",
        "stop_ids",
        "stream",
        "top_n",
    )

    def __init__(
        self, request: PreprocessedRequest, context: Context, max_tokens: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        sc = request.stop_conditions
        self.request = request
        self.context = context
        self.prompt_ids = request.token_ids
        self.max_tokens = max_tokens
        self.min_tokens = sc.min_tokens or 0
        self.stop_ids = frozenset(stop_token_ids(request))
        self.top_n = request.output_options.logprobs  # None: no logprobs asked
        self.loop = loop
        self.out: asyncio.Queue[LLMEngineOutput | BaseException] = asyncio.Queue()
        self.cancelled = False  # set from the event loop; read by the worker
        self.stream: Any = None
        self.count = 0

    def put(self, item: LLMEngineOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class Worker(threading.Thread):
    """Owns the Runner (see the module docstring)."""

    def __init__(self, build: Callable[[], Any], args: MistralrsArgs, vocab: TokenBytes) -> None:
        super().__init__(name="mistralrs-worker", daemon=True)
        self._build = build
        self.args = args
        self.vocab = vocab
        self.runner: Any = None
        self.mistralrs: Any = None
        self._inbox: collections.deque[Any] = collections.deque()
        self._wake = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._stopping = False
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._warned: set[str] = set()

    # -- called from the event loop --

    def submit(self, job: Job) -> None:
        self._send(job)

    def call(self, fn: Callable[[Any], Any], loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = loop.create_future()
        self._send((fn, fut, loop))
        return fut

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def pending(self) -> int:
        return len(self._inbox) + len(self._waiting) + len(self._running)

    def _send(self, item: Any) -> None:
        with self._wake:
            if self._stopping:
                raise EngineShutdown("the mistralrs engine shut down")
            self._inbox.append(item)
            self._wake.notify()

    # -- the thread --

    def run(self) -> None:
        try:
            self.mistralrs = import_mistralrs()
            self.runner = self._build()
        except BaseException as err:  # reported by start()
            self.load_error = err
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        finally:
            for job in [*self._running, *self._waiting]:
                job.stream = None
                job.put(EngineShutdown("the mistralrs engine shut down"))
            self._running.clear()
            self._waiting.clear()
            for item in self._inbox:
                if isinstance(item, Job):
                    item.put(EngineShutdown("the mistralrs engine shut down"))
            self.runner = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._running or self._waiting or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    return
                inbox = list(self._inbox)
                self._inbox.clear()
            for item in inbox:
                if isinstance(item, Job):
                    self._waiting.append(item)
                else:
                    self._call(*item)
            while self._waiting and len(self._running) < self.args.max_seqs:
                job = self._waiting.popleft()
                if job.cancelled:
                    job.put(LLMEngineOutput(finish_reason="cancelled"))
                elif self._open(job):
                    self._running.append(job)
            for job in list(self._running):
                if not self._step(job):
                    job.stream = None  # dropping the stream stops its generation in mistral.rs
                    self._running.remove(job)

    def _call(
        self, fn: Callable[[Any], Any], fut: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        def deliver(ok: bool, value: Any) -> None:
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        try:
            result = (True, fn(self.runner))
        except Exception as err:
            result = (False, err)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, *result)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg + " (logged once)", *args)

    def _open(self, job: Job) -> bool:
        """Detokenize the prompt, check the round trip and start the mistral.rs stream."""
        runner, mrs = self.runner, self.mistralrs
        try:
            text = runner.detokenize_text(job.prompt_ids, False)
            if runner.tokenize_text(text, False, None) != job.prompt_ids:
                self._warn_once(
                    "prompt",
                    "mistralrs: a prompt's token ids do not survive detokenize/tokenize; it is served "
                    "with its text's own tokenization",
                )
            req = mrs.ChatCompletionRequest(
                messages=[{"role": "user", "content": text}],
                model="default",
                stream=True,
                logprobs=True,
                top_logprobs=max(job.top_n or 0, 1),
                max_tokens=job.max_tokens,
                ignore_eos=True,
                **sampling_fields(job.request),
            )
            job.stream = iter(runner.send_chat_completion_request(req))
        except EngineError as err:
            job.put(err)
            return False
        except Exception as err:
            job.put(EngineError(f"mistralrs refused the request: {err}"))
            return False
        return True

    def _step(self, job: Job) -> bool:
        """Read one chunk of a running job; False once the job is finished."""
        if job.cancelled:
            job.put(LLMEngineOutput(finish_reason="cancelled"))
            return False
        try:
            chunk = next(job.stream)
        except StopIteration:
            job.put(LLMEngineOutput(finish_reason="stop", completion_usage=self._usage(job, None)))
            return False
        except Exception as err:
            job.put(EngineError(f"mistralrs failed: {err}"))
            return False
        if not chunk.choices:
            return True
        choice = chunk.choices[0]
        ids, logprob = self._token_ids(choice)
        finish = _FINISH.get(choice.finish_reason or "", "stop") if choice.finish_reason else None
        for i, token_id in enumerate(ids):
            job.count += 1
            last = job.count >= job.max_tokens
            if token_id in job.stop_ids and job.count > job.min_tokens:
                finish, ids = "stop", ids[: i + 1]
                break
            if last:
                finish, ids = finish or "length", ids[: i + 1]
                break
        out = LLMEngineOutput(token_ids=ids, finish_reason=finish)  # type: ignore[arg-type]
        if job.top_n is not None and logprob is not None and ids:
            out.log_probs = [logprob] * len(ids)
            tops = choice.logprobs.top_logprobs or ()
            top = [TopLogprob(token_id=int(t.token), logprob=float(t.logprob)) for t in tops[: job.top_n]]
            out.top_logprobs = [top] * len(ids)
        if finish is not None:
            usage = self._usage(job, chunk.usage)
            out.completion_usage = usage
            out.cached_tokens = usage.cached_tokens
        job.put(out)
        return finish is None

    def _token_ids(self, choice: Any) -> tuple[list[int], float | None]:
        lp = choice.logprobs
        if lp is not None and lp.bytes is not None:
            hints = [t.token for t in (lp.top_logprobs or ())]
            token_id = self.vocab.lookup(bytes(lp.bytes), hints)
            if token_id is not None:
                return [token_id], lp.logprob
            raw = bytes(lp.bytes)
        else:
            raw = (choice.delta.content or "").encode()
        if not raw:
            return [], None
        self._warn_once(
            "bytes",
            "mistralrs: a generated token's bytes %r are not in the vocabulary map; its ids are "
            "re-tokenized from text and may differ",
            raw,
        )
        return list(self.runner.tokenize_text(raw.decode("utf-8", "replace"), False, None)), None

    def _usage(self, job: Job, usage: Any) -> CompletionUsage:
        cached = None
        if usage is not None:
            details = getattr(usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) if details is not None else None
            if usage.prompt_tokens != len(job.prompt_ids):
                self._warn_once(
                    "usage",
                    "mistralrs: it counted %d prompt tokens where the request has %d",
                    usage.prompt_tokens,
                    len(job.prompt_ids),
                )
        return CompletionUsage(
            prompt_tokens=len(job.prompt_ids), completion_tokens=job.count, cached_tokens=cached
        )
