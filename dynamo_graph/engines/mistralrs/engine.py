"""`out=mistralrs`: mistral.rs (the `mistralrs` PyO3 wheel) behind the `LLMEngine` contract as a
token-id engine, over mistral.rs's text-only API. The user's manual (install, the token-id bridge
and why it is exact, threads, sampling, settings) is docs/engines/mistralrs.md.

Contract: the prompt's ids go in detokenized through an identity chat template (below), the
output's ids come back from the sampled tokens' bytes (vocab.py); stop and eos ids are applied
here per token, as mistral.rs is told to ignore eos; one thread owns the Runner (worker.py), and
this module bridges it to asyncio: limits, queueing (`EngineOverloaded` beyond `max_waiting`),
cancellation and shutdown. mistralrs is imported when an engine is built (`MistralrsError` naming
the `dyngraph[mistralrs]` extra without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineOverloaded, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.engines.mistralrs.args import (
    ARCH_BY_MODEL_TYPE,
    MistralrsArgs,
    MistralrsError,
    cpu_build,
    import_mistralrs,
    sampling_fields,
)
from dynamo_graph.engines.mistralrs.vocab import TokenBytes
from dynamo_graph.engines.mistralrs.worker import Job, Worker
from dynamo_graph.engines.sampling import capped_max_tokens
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.settings import EngineSettings
    from dynamo_graph.llm.model_source import LocalModel

log = logging.getLogger(__name__)

# The chat template the Runner renders: the (already templated) prompt, verbatim.
IDENTITY_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

# ---- the engine --------------------------------------------------------------------------------


# The optional request features (llm/openai.py CAPABILITIES) this engine honours (docs/engines/mistralrs.md).
CAPABILITIES = ("logprobs", "guided_json", "guided_regex", "guided_choice")


class MistralrsEngine(LLMEngine):
    """mistral.rs with a token-id interface; see docs/engines/mistralrs.md."""

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
        self._worker: Worker | None = None
        self._template_dir: tempfile.TemporaryDirectory[str] | None = None
        self._jobs: set[Job] = set()
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
        name = self.args.dtype or ("f32" if cpu_build() else "auto")
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
            member = members.get(wanted) or members.get(ARCH_BY_MODEL_TYPE.get(wanted, "").lower())
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
        candidates = [ARCH_BY_MODEL_TYPE.get(model_type, ""), model_type.replace("_", "")]
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
        worker = Worker(self._runner_factory(template), self.args, self._vocab)
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
        return capped_max_tokens(request, limit)

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
        sampling_fields(request)  # refuse bad sampling options before queueing
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled")
            return
        if worker.pending() >= self.args.max_seqs + self.args.max_waiting:
            raise EngineOverloaded(
                f"mistralrs: {self.args.max_seqs} requests are running and {self.args.max_waiting} "
                "waiting (max_waiting); try again later"
            )
        job = Job(request, context, max_tokens, asyncio.get_running_loop())
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
