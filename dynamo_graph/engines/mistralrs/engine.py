"""`out=mistralrs`: mistral.rs (the `mistralrs` PyO3 wheel, 0.9.5) behind the `LLMEngine` contract.

Install with `pip install 'dyngraph[mistralrs]'`; the package is imported only when this engine is
built. It loads an HF safetensors folder (`Which.Plain`, the architecture from config.json's
`model_type`/`architectures`) or a GGUF file (`Which.GGUF`, with the folder's tokenizer.json when
there is one).

Token ids in and out, over a text-only API
-------------------------------------------
mistral.rs's Python API takes no token-id prompt and streams text. This engine still registers
as a **tokens-input** engine (a Backend-type model), so the frontend's chat template, stop strings,
usage counting, migration and kv routing work as with any other engine. The bridge is exact:

- Prompt: the ids are detokenized (special tokens kept) by the Runner and sent as a chat request
  rendered by an *identity* chat template (`jinja_explicit`, the message content verbatim). The
  chat path tokenizes the rendered text without adding special tokens, so mistral.rs sees the
  same ids as long as `tokenize(detokenize(ids)) == ids`. That is checked for every request
  (on the worker thread, with the Runner's own tokenizer); it holds for canonical tokenizations of
  byte-level BPE models (e.g. every prompt the frontend builds from text). When it does not (ids
  no tokenizer would produce, e.g. a hand-made token-id prompt), the request is still served with
  the text's own tokenization and a warning is logged; usage then counts the request's ids.
  mistral.rs's prompt token count is compared with ours and a mismatch is logged, too.
- Output: re-tokenizing the streamed *text* would not be exact (a token may be half of a UTF-8
  character, which the text delta shows as U+FFFD, and a model may emit non-canonical splits).
  Instead every request asks for logprobs: each chunk then carries the sampled token's raw
  `bytes`, which are mapped back to the token id through the model's vocabulary (built once from
  the tokenizer: byte-level BPE tokens decode to their bytes, added tokens to their content).
  Where bytes map to several ids, the chunk's top-logprob ids decide; bytes that map to no id (a
  tokenizer this map does not understand) fall back to re-tokenizing them, with a warning.
  Evidence: tests/integration/test_mistralrs_engine.py checks greedy ids against llama.cpp on
  the same prompt and the ids' detokenization against the streamed bytes, sampled runs included.

Stop conditions are applied here per token (mistral.rs is always asked to ignore eos): a stop
or (unless ignore_eos) eos id past `min_tokens` ends the stream with "stop" and that id (the
postprocessor counts it and hides it); `min_tokens` thus follows the postprocessor's rule (an
eos at or before min_tokens is an ordinary token) rather than masking eos. `max_tokens` is
capped by the context length. Stop strings are left to the postprocessor, which closes the
stream (and with it the mistral.rs request) once one matches.

Threads
-------
A `Runner` is not re-entrant ("Already borrowed"), so one dedicated worker thread owns it: it is
built there, and every Runner call (tokenize, detokenize, submit) and every read of a response
stream happens there. Streams of up to `max_seqs` requests are read round-robin, one chunk each
per round, so mistral.rs batches them (it decodes one token per running sequence per step);
their chunks reach the asyncio side through `loop.call_soon_threadsafe`. Requests beyond
`max_seqs` wait in a FIFO on the worker (at most `max_waiting`; one more is refused with
`EngineOverloaded`, HTTP 503). A cancelled request (context stopped, or its consumer gone) is
dropped from the worker at its next turn, which drops the mistral.rs stream and so stops its
generation; the stream ends with finish_reason "cancelled". `cleanup()` stops the worker and
ends every open stream with `EngineShutdown`; it is idempotent and safe before `start()`.

Sampling: temperature 0 or unset is greedy; top_p, top_k, min_p, presence/frequency/repetition
penalties and logit_bias are passed on; guided_regex / guided_json / guided_choice become
mistral.rs grammars (regex, json_schema), which the card advertises. guided_grammar is not: the
grammars mistral.rs parses are Lark and llguidance's, not the GBNF/EBNF vLLM and llama.cpp users
send, so the frontend answers it with a 400 naming the field and the engine. Logprobs: mistral.rs's
own, the sampled token's and the request's `top_logprobs` most likely (token ids and values).
A seed is ignored (mistral.rs's CPU rng cannot be seeded per request), and
n / best_of above 1 are refused.

Settings (`--extra-engine-args` JSON; unknown keys are refused with the list):

| key | default | meaning |
|---|---|---|
| dtype | "f32" on the CPU build, else "auto" | weights dtype: auto, f32, f16, bf16 |
| max_seqs | 16 | requests running (batched) at once |
| max_waiting | 256 | requests waiting for a slot before new ones are refused |
| prefix_cache_n | 16 | sequences kept in mistral.rs's prefix cache (0 disables it) |
| no_kv_cache | false | disable the KV cache |
| in_situ_quant | null | in-situ quantization, e.g. "Q4K", "Q8_0" |
| arch | from config.json | mistral.rs architecture name, e.g. "llama", "qwen2" |

`--context-length` has no mistral.rs setting: it is enforced here (prompt + output) and may not
exceed the model's own maximum (a larger value is lowered, with a warning).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import importlib.metadata
import json
import logging
import re
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineOverloaded, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest, TopLogprob
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.llm.detokenizer import BYTE_LEVEL_CHAR_TO_BYTE
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'dyngraph[mistralrs]'"
# The chat template the Runner renders: the (already templated) prompt, verbatim.
IDENTITY_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# mistral.rs finish reasons -> ours.
_FINISH = {"stop": "stop", "length": "length", "canceled": "cancelled", "cancelled": "cancelled"}
# config.json model_type -> mistral.rs Architecture member.
_ARCH_BY_MODEL_TYPE = {
    "mistral": "Mistral",
    "gemma": "Gemma",
    "mixtral": "Mixtral",
    "llama": "Llama",
    "phi": "Phi2",
    "phi3": "Phi3",
    "phimoe": "Phi3_5MoE",
    "qwen2": "Qwen2",
    "gemma2": "Gemma2",
    "starcoder2": "Starcoder2",
    "deepseek_v2": "DeepseekV2",
    "deepseek_v3": "DeepseekV3",
    "qwen3": "Qwen3",
    "glm4": "GLM4",
    "glm4_moe": "GLM4Moe",
    "glm4_moe_lite": "GLM4MoeLite",
    "qwen3_moe": "Qwen3Moe",
    "smollm3": "SmolLm3",
    "granitemoehybrid": "GraniteMoeHybrid",
    "gpt_oss": "GptOss",
    "qwen3_next": "Qwen3Next",
    "lfm2": "Lfm2",
    "lfm2_moe": "Lfm2Moe",
}
_DTYPES = ("auto", "f32", "f16", "bf16")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class MistralrsError(RunConfigError):
    """mistral.rs is missing, a setting is bad, or the model cannot be loaded (printed by the CLI)."""


def import_mistralrs() -> Any:
    try:
        return importlib.import_module("mistralrs")
    except ImportError as err:
        raise MistralrsError(
            f"out=mistralrs needs the mistralrs package, which is not installed ({err}); "
            f"install it with: {INSTALL_HINT}"
        ) from None


def _cpu_build() -> bool:
    """The plain `mistralrs` wheel is the CPU build (GPU builds are mistralrs-cuda, -metal, ...)."""
    try:
        importlib.metadata.distribution("mistralrs")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class MistralrsArgs:
    dtype: str | None = None  # None: f32 on the CPU build, else auto
    max_seqs: int = 16
    max_waiting: int = 256
    prefix_cache_n: int = 16
    no_kv_cache: bool = False
    in_situ_quant: str | None = None
    arch: str | None = None

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> MistralrsArgs:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise MistralrsError(
                f"--extra-engine-args: unknown mistralrs setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(known)}"
            )
        args = cls(**data)
        args.check()
        return args

    def check(self) -> None:
        def bad(key: str, want: str) -> MistralrsError:
            return MistralrsError(f"--extra-engine-args: {key} must be {want}, not {getattr(self, key)!r}")

        if self.dtype is not None and (not isinstance(self.dtype, str) or self.dtype.lower() not in _DTYPES):
            raise bad("dtype", f"one of {', '.join(_DTYPES)}")
        for key, minimum in (("max_seqs", 1), ("max_waiting", 0), ("prefix_cache_n", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise bad(key, f"an integer >= {minimum}")
        if not isinstance(self.no_kv_cache, bool):
            raise bad("no_kv_cache", "true or false")
        for key in ("in_situ_quant", "arch"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise bad(key, "a string")


# ---- token bytes -> ids ------------------------------------------------------------------------


class TokenBytes:
    """Maps a token's raw bytes (as mistral.rs reports them in logprobs) back to its id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        byte_level = "ByteLevel" in json.dumps(decoder)
        u2b = BYTE_LEVEL_CHAR_TO_BYTE
        added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.ids: dict[bytes, int] = {}
        self.ambiguous: dict[bytes, list[int]] = {}
        for text, token_id in sorted(
            tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]
        ):
            if token_id in added:
                raw = added[token_id].encode()
            elif byte_level and all(c in u2b for c in text):
                raw = bytes(u2b[c] for c in text)
            elif (m := _BYTE_FALLBACK.fullmatch(text)) is not None:
                raw = bytes([int(m.group(1), 16)])
            else:
                raw = text.replace("\u2581", " ").encode()
            first = self.ids.setdefault(raw, token_id)
            if first != token_id:
                self.ambiguous.setdefault(raw, [first]).append(token_id)

    def lookup(self, raw: bytes, hints: list[int]) -> int | None:
        choices = self.ambiguous.get(raw)
        if choices is not None:
            return next((h for h in hints if h in choices), choices[0])
        return self.ids.get(raw)


# ---- the worker thread -------------------------------------------------------------------------


class _Job:
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
        stop = set(sc.stop_token_ids or ())
        if not sc.ignore_eos:
            stop.update(request.eos_token_ids)
            stop.update(sc.stop_token_ids_hidden or ())
        self.stop_ids = frozenset(stop)
        self.top_n = request.output_options.logprobs  # None: no logprobs asked
        self.loop = loop
        self.out: asyncio.Queue[LLMEngineOutput | BaseException] = asyncio.Queue()
        self.cancelled = False  # set from the event loop; read by the worker
        self.stream: Any = None
        self.count = 0

    def put(self, item: LLMEngineOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class _Worker(threading.Thread):
    """Owns the Runner; see the module docstring."""

    def __init__(self, build: Callable[[], Any], args: MistralrsArgs, vocab: TokenBytes) -> None:
        super().__init__(name="mistralrs-worker", daemon=True)
        self._build = build
        self.args = args
        self.vocab = vocab
        self.runner: Any = None
        self.mistralrs: Any = None
        self._inbox: collections.deque[Any] = collections.deque()
        self._wake = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        self._stopping = False
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._warned: set[str] = set()

    # -- called from the event loop --

    def submit(self, job: _Job) -> None:
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
                if isinstance(item, _Job):
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
                if isinstance(item, _Job):
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

    def _open(self, job: _Job) -> bool:
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
                **_sampling(job.request),
            )
            job.stream = iter(runner.send_chat_completion_request(req))
        except EngineError as err:
            job.put(err)
            return False
        except Exception as err:
            job.put(EngineError(f"mistralrs refused the request: {err}"))
            return False
        return True

    def _step(self, job: _Job) -> bool:
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

    def _usage(self, job: _Job, usage: Any) -> CompletionUsage:
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


def _sampling(request: PreprocessedRequest) -> dict[str, Any]:
    """mistral.rs request fields for the request's sampling options."""
    so = request.sampling_options
    if (so.n or 1) > 1 or (so.best_of or 1) > 1:
        raise InvalidArgument(
            "out=mistralrs generates one choice per request (n and best_of must be 1)", param="n"
        )
    kw: dict[str, Any] = {"temperature": so.temperature or 0.0}
    if so.temperature:
        for key in ("top_p", "top_k", "min_p"):
            value = getattr(so, key)
            if value is not None:
                kw[key] = value
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(so, key)
        if value is not None:
            kw[key] = value
    if so.logit_bias:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in so.logit_bias.items()}
        except ValueError:
            raise InvalidArgument("logit_bias keys must be token ids", param="logit_bias") from None
    if so.guided_regex is not None:
        kw["grammar"], kw["grammar_type"] = so.guided_regex, "regex"
    elif so.guided_json is not None:
        schema = so.guided_json if isinstance(so.guided_json, str) else json.dumps(so.guided_json)
        kw["grammar"], kw["grammar_type"] = schema, "json_schema"
    elif so.guided_choice:
        kw["grammar"] = "|".join(f"({re.escape(c)})" for c in so.guided_choice)
        kw["grammar_type"] = "regex"
    elif so.guided_grammar is not None:
        raise InvalidArgument("out=mistralrs does not support guided_grammar", param="guided_grammar")
    return kw


# ---- the engine --------------------------------------------------------------------------------


# The optional request features (llm/openai.py CAPABILITIES) this engine honours; see above.
CAPABILITIES = ("logprobs", "guided_json", "guided_regex", "guided_choice")


class MistralrsEngine(LLMEngine):
    """mistral.rs with a token-id interface; see the module docstring."""

    def __init__(
        self,
        model: LocalModel,
        args: MistralrsArgs | None = None,
        *,
        context_length: int | None = None,
    ) -> None:
        self.mistralrs = import_mistralrs()
        self.model = model
        self.args = args or MistralrsArgs()
        self.requested_context_length = context_length
        self.context_length: int | None = None
        self._vocab = TokenBytes(model.load_tokenizer())
        self._worker: _Worker | None = None
        self._template_dir: tempfile.TemporaryDirectory[str] | None = None
        self._jobs: set[_Job] = set()
        self._idle = asyncio.Event()
        self._config: EngineConfig | None = None
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> MistralrsEngine:
        if model is None:
            raise MistralrsError("out=mistralrs needs a model: pass --model-path DIR|FILE.gguf")
        args = MistralrsArgs.from_mapping(cfg.engine_args())
        if cfg.kv_cache_block_size is not None:
            log.warning("mistralrs: --kv-cache-block-size has no effect (no paged attention on CPU)")
        return cls(model, args, context_length=cfg.context_length)

    # ---- loading ---------------------------------------------------------------------------

    def _dtype(self) -> Any:
        name = self.args.dtype or ("f32" if _cpu_build() else "auto")
        return {
            "auto": self.mistralrs.ModelDType.Auto,
            "f32": self.mistralrs.ModelDType.F32,
            "f16": self.mistralrs.ModelDType.F16,
            "bf16": self.mistralrs.ModelDType.BF16,
        }[name.lower()]

    def _architecture(self) -> Any:
        arch_enum = self.mistralrs.Architecture  # a PyO3 enum: members are its public attributes
        members = {
            name.lower(): getattr(arch_enum, name) for name in dir(arch_enum) if not name.startswith("_")
        }
        known = ", ".join(sorted(members))
        if self.args.arch is not None:
            wanted = self.args.arch.lower()
            member = members.get(wanted) or members.get(_ARCH_BY_MODEL_TYPE.get(wanted, "").lower())
            if member is None:
                raise MistralrsError(
                    f"--extra-engine-args: arch {self.args.arch!r} is not a mistral.rs architecture; "
                    f"known: {known}"
                )
            return member
        config: dict[str, Any] = {}
        if self.model.config_json is not None:
            with contextlib.suppress(OSError, ValueError):
                config = json.loads(self.model.config_json.read_text(encoding="utf-8"))
        model_type = str(config.get("model_type") or "").lower()
        candidates = [_ARCH_BY_MODEL_TYPE.get(model_type, ""), model_type.replace("_", "")]
        for arch_name in config.get("architectures") or []:
            candidates.append(re.sub(r"(ForCausalLM|LMHeadModel|Model)$", "", str(arch_name)))
        for candidate in candidates:
            member = members.get(candidate.lower())
            if member is not None:
                return member
        raise MistralrsError(
            f"{self.model.source}: mistral.rs has no text architecture for model_type {model_type!r} "
            f"(architectures {config.get('architectures')}); name one with --extra-engine-args "
            f'{{"arch": NAME}}, one of: {known}'
        )

    def _which(self) -> Any:
        mrs, model = self.mistralrs, self.model
        tokenizer_json = str(model.tokenizer_json) if model.tokenizer_json is not None else None
        if model.kind == "gguf":
            assert model.gguf_path is not None
            return mrs.Which.GGUF(
                quantized_model_id=str(model.gguf_path.parent),
                quantized_filename=model.gguf_path.name,
                tok_model_id=str(model.tokenizer_json.parent) if model.tokenizer_json is not None else None,
                dtype=self._dtype(),
            )
        return mrs.Which.Plain(
            model_id=str(model.root),
            arch=self._architecture(),
            tokenizer_json=tokenizer_json,
            dtype=self._dtype(),
        )

    def _runner_factory(self, template: Path) -> Callable[[], Any]:
        which = self._which()  # config errors surface here, before the thread starts
        a = self.args

        def build() -> Any:
            return self.mistralrs.Runner(
                which=which,
                max_seqs=a.max_seqs,
                no_kv_cache=a.no_kv_cache,
                prefix_cache_n=a.prefix_cache_n,
                token_source="none",
                jinja_explicit=str(template),
                in_situ_quant=a.in_situ_quant,
            )

        return build

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the mistralrs engine was shut down")
        if self._config is not None:
            return self._config
        self._template_dir = tempfile.TemporaryDirectory(prefix="dyngraph-mistralrs-")
        template = Path(self._template_dir.name) / "identity.jinja"
        template.write_text(IDENTITY_TEMPLATE, encoding="utf-8")
        worker = _Worker(self._runner_factory(template), self.args, self._vocab)
        self._worker = worker
        worker.start()
        await asyncio.to_thread(worker.ready.wait)
        if worker.load_error is not None:
            err = worker.load_error
            if isinstance(err, RunConfigError):
                raise err
            raise MistralrsError(f"mistralrs could not load {self.model.source}: {err}") from err
        model_max = await worker.call(lambda r: r.max_sequence_length(), asyncio.get_running_loop())
        model_max = model_max or self.model.context_length
        length = self.requested_context_length or model_max
        if model_max is not None and length is not None and length > model_max:
            log.warning(
                "mistralrs: --context-length %d is more than the model's maximum %d; using %d",
                length,
                model_max,
                model_max,
            )
            length = model_max
        self.context_length = length
        self._config = EngineConfig(
            model_input="tokens",
            context_length=length,
            max_num_seqs=self.args.max_seqs,
            capabilities=list(CAPABILITIES),
        )
        return self._config

    async def drain(self) -> None:
        while self._jobs:
            self._idle.clear()
            await self._idle.wait()

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
            await asyncio.to_thread(worker.join, 30.0)
        for job in list(self._jobs):
            job.out.put_nowait(EngineShutdown("the mistralrs engine shut down"))
        if self._template_dir is not None:
            self._template_dir.cleanup()
            self._template_dir = None

    async def abort(self, context: Context) -> None:
        for job in self._jobs:
            if job.context is context:
                job.cancelled = True

    # ---- requests --------------------------------------------------------------------------

    def _limits(self, request: PreprocessedRequest) -> int:
        n = len(request.token_ids)
        if n == 0:
            raise InvalidArgument("the prompt is empty: at least one token is needed", param="prompt")
        sc = request.stop_conditions
        if sc.max_tokens is not None and sc.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, not {sc.max_tokens}", param="max_tokens")
        vocab = len(self._vocab.ids) + sum(len(v) - 1 for v in self._vocab.ambiguous.values())
        bad = next((t for t in request.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="token_ids"
            )
        limit = self.context_length
        if limit is None:
            return sc.max_tokens or 2**31 - 1
        if n >= limit:
            raise InvalidArgument(
                f"the prompt has {n} tokens; this model's context length {limit} leaves no room for "
                f"output: at most {limit - 1} prompt tokens",
                param="prompt",
            )
        return min(sc.max_tokens or limit - n, limit - n)

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if not isinstance(request, PreprocessedRequest):
            raise InvalidArgument("out=mistralrs takes pre-processed requests (token ids)", param="model")
        worker = self._worker
        if self._closed:
            raise EngineShutdown("the mistralrs engine shut down")
        if worker is None:
            raise EngineError("the mistralrs engine is not started")
        max_tokens = self._limits(request)
        _sampling(request)  # refuse bad sampling options before queueing
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled")
            return
        if worker.pending() >= self.args.max_seqs + self.args.max_waiting:
            raise EngineOverloaded(
                f"mistralrs: {self.args.max_seqs} requests are running and {self.args.max_waiting} "
                "waiting (max_waiting); try again later"
            )
        job = _Job(request, context, max_tokens, asyncio.get_running_loop())
        self._jobs.add(job)
        stopped = asyncio.ensure_future(context.stopped())
        try:
            worker.submit(job)
            while True:
                get = asyncio.ensure_future(job.out.get())
                await asyncio.wait((get, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    job.cancelled = True
                    yield LLMEngineOutput(
                        finish_reason="cancelled",
                        completion_usage=CompletionUsage(
                            prompt_tokens=len(request.token_ids), completion_tokens=job.count
                        ),
                    )
                    return
                item = get.result()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled = True  # no-op once finished; stops the worker's stream otherwise
            stopped.cancel()
            self._jobs.discard(job)
            if not self._jobs:
                self._idle.set()
