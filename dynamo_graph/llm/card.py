"""The model deployment card (MDC): what a worker publishes about the model it serves.

A frontend builds its pre/post-processing from the card alone, so the card inlines the chat
template and names the tokenizer/config files with checksums. Every worker of one model must
publish the same `mdcsum()`; it covers content, never paths, because hosts lay files out
differently. Fields follow Dynamo's `lib/llm/src/model_card.rs` (docs/contracts.md, "Discovery keys").
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import msgspec

from dynamo_graph.llm.model_source import LocalModel
from dynamo_graph.llm.reasoning import REASONING_PARSERS
from dynamo_graph.llm.tool_calls import TOOL_CALL_PARSERS

ModelType = Literal["chat", "completions", "embedding", "prefill"]
ModelInput = Literal["tokens", "text"]
DEFAULT_MODEL_TYPE: list[ModelType] = ["chat", "completions"]
_CHUNK = 1 << 20


class CheckedFile(msgspec.Struct, frozen=True):
    """A file the frontend may need, with a checksum of its bytes ("blake2b:<hex>")."""

    path: str
    checksum: str

    @classmethod
    def from_path(cls, path: Path) -> CheckedFile:
        return cls(path=str(Path(path).absolute()), checksum=f"blake2b:{_blake2b_file(path)}")


def _blake2b_file(path: Path, limit: int | None = None) -> str:
    """blake2b of the file's bytes, or of its first `limit` bytes."""
    h = hashlib.blake2b()
    left = limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


def _gguf_checked_file(path: Path) -> CheckedFile:
    """A GGUF's checksum covers its header (metadata, tokenizer, tensor index), not the weights:
    hashing many GB at every worker start costs seconds, and the header already pins the model."""
    import gguf  # only GGUF models pay its (numpy) import

    header = gguf.GGUFReader(path).data_offset
    return CheckedFile(
        path=str(path.absolute()), checksum=f"blake2b-gguf-header:{_blake2b_file(path, header)}"
    )


def slugify(name: str) -> str:
    """Dynamo's Slug::slugify: lowercase; anything but ASCII letters, digits, '-' and '_' -> '_'."""
    return "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "_" for c in name.lower())


def check_parser_name(kind: str, name: str | None, valid: tuple[str, ...]) -> None:
    if name is not None and name not in valid:
        raise ValueError(f"unknown {kind} parser {name!r}; valid names: {', '.join(valid)}")


# A worker's adapter-control endpoint, beside its generate endpoint (backend/lora.py).
LORA_ENDPOINT = "lora"


class LoraInfo(msgspec.Struct, frozen=True):
    """What makes a card an adapter's: the base model it applies to (`/v1/models` lists it as the
    adapter's `parent`, as vLLM does) and where the worker loaded it from."""

    base_model: str
    path: str


class ModelDeploymentCard(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Dynamo's MDC. `files` keys: config, tokenizer, tokenizer_config, generation_config, gguf."""

    display_name: str
    slug: str
    source_path: str
    model_type: list[ModelType] = msgspec.field(default_factory=lambda: list(DEFAULT_MODEL_TYPE))
    model_input: ModelInput = "tokens"
    files: dict[str, CheckedFile] = msgspec.field(default_factory=dict)
    chat_template: str | None = None
    context_length: int | None = None
    kv_cache_block_size: int = 16
    migration_limit: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    user_data: dict[str, Any] | None = None
    runtime_config: dict[str, Any] | None = None
    # How the frontend reads the model's output (--dyn-tool-call-parser, --dyn-reasoning-parser).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # The engine serving the model and the optional request features it honours ("logprobs",
    # "guided_json", "guided_grammar", "guided_choice", "guided_regex"): the frontend answers a
    # request that needs another one with a 400 instead of ignoring what was asked.
    engine: str | None = None
    capabilities: list[str] = msgspec.field(default_factory=list)
    # Set on the card of a LoRA adapter a worker serves beside its base model (backend/lora.py).
    lora: LoraInfo | None = None

    def __post_init__(self) -> None:
        check_parser_name("tool call", self.tool_call_parser, TOOL_CALL_PARSERS)
        check_parser_name("reasoning", self.reasoning_parser, REASONING_PARSERS)

    @classmethod
    def from_local_model(
        cls,
        model: LocalModel,
        *,
        model_input: ModelInput = "tokens",
        model_type: list[ModelType] | None = None,
        context_length: int | None = None,
        kv_cache_block_size: int = 16,
        migration_limit: int = 0,
        user_data: dict[str, Any] | None = None,
    ) -> ModelDeploymentCard:
        """Build the card a worker publishes; `context_length` overrides the model's own
        (dynamo-run's --context-length)."""
        paths = {
            "config": model.config_json,
            "tokenizer": model.tokenizer_json,
            "tokenizer_config": model.tokenizer_config_json,
            "generation_config": model.generation_config_json,
        }
        files = {k: CheckedFile.from_path(p) for k, p in paths.items() if p is not None}
        if model.gguf_path is not None:
            files["gguf"] = _gguf_checked_file(model.gguf_path)
        local = model.repo_id is None
        return cls(
            display_name=model.display_name,
            slug=slugify(model.display_name),
            source_path=str((model.gguf_path or model.root).absolute()) if local else model.source,
            model_type=list(model_type or DEFAULT_MODEL_TYPE),
            model_input=model_input,
            files=files,
            chat_template=model.chat_template,
            context_length=context_length if context_length is not None else model.context_length,
            kv_cache_block_size=kv_cache_block_size,
            migration_limit=migration_limit,
            bos_token_id=model.bos_token_id,
            eos_token_ids=list(model.eos_token_ids),
            user_data=user_data,
        )

    @classmethod
    def without_files(
        cls, name: str, *, model_input: ModelInput = "text", context_length: int | None = None
    ) -> ModelDeploymentCard:
        """A card for an engine that needs no model files (echo_full, or a model it loads itself)."""
        return cls(
            display_name=name,
            slug=slugify(name),
            source_path=name,
            model_input=model_input,
            context_length=context_length,
        )

    def for_adapter(self, name: str, path: str) -> ModelDeploymentCard:
        """The card of LoRA adapter `name` on this (base) card's model: the same tokenizer,
        template and engine, under the adapter's own name."""
        return msgspec.structs.replace(
            self, display_name=name, slug=slugify(name), lora=LoraInfo(self.display_name, path)
        )

    def mdcsum(self) -> str:
        """blake2b over what must match across workers of one model; paths are left out."""
        content = [
            self.display_name,
            sorted((name, f.checksum) for name, f in self.files.items()),
            self.chat_template,
            self.context_length,
            self.kv_cache_block_size,
        ]
        # Only when set, so cards without parsers keep the checksums they always had.
        if self.tool_call_parser is not None or self.reasoning_parser is not None:
            content.append([self.tool_call_parser, self.reasoning_parser])
        if self.lora is not None:  # an adapter's workers must agree on its base model
            content.append(["lora", self.lora.base_model])
        # An embedding worker of a model name that generating workers serve must not join their pool.
        if "embedding" in self.model_type:
            content.append("embedding")
        return hashlib.blake2b(msgspec.json.encode(content)).hexdigest()

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> ModelDeploymentCard:
        return msgspec.json.decode(data, type=cls)
