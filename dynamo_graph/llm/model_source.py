"""Resolve a model spec (HF folder, GGUF file, hub repo id) to local files, as dynamo-run does.

Everything downstream (the model card, the preprocessor, engines) works from a `LocalModel`: the
paths of the HF side files, the chat template, the special tokens and the context length, read
once here with the precedence rules HF tooling uses. A GGUF carries its own tokenizer, so one can
be served without any HF files; `--model-config DIR` supplies them when the GGUF's are not enough.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

ModelKind = Literal["hf", "gguf"]

# What a hub download fetches: configs, tokenizers, templates and weights; no docs or other formats.
HUB_ALLOW_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.safetensors"]
_HUB_PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# tokenizer_config's model_max_length is "unlimited" (int(1e30)) when the tokenizer sets none.
_SANE_MAX_LENGTH = 10**8

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) we can reproduce exactly with `tokenizers`:
# the split regex (None = GPT-2's, built into ByteLevel) and whether BPE skips merges for whole-vocab
# words (llama.cpp sets ignore_merges for its LLAMA3 type, as HF's Llama-3 tokenizer.json does).
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "gpt-2": (None, False),
    "llama-bpe": (_LLAMA3_REGEX, True),
    "llama3": (_LLAMA3_REGEX, True),
    "llama-v3": (_LLAMA3_REGEX, True),
}


class ModelResolutionError(Exception):
    """A model spec could not be turned into usable local files; the message says how to fix it."""


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """The tokenizer and generation metadata of a GGUF file (the tensors are not read)."""

    architecture: str
    context_length: int | None
    tokenizer_model: str | None
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @classmethod
    def read(cls, path: Path) -> GGUFTokenizerInfo:
        import gguf  # with numpy, ~0.1 s to import: only GGUF models pay it

        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:  # gguf raises ValueError/struct errors on corrupt files
            raise ModelResolutionError(f"{path}: not a readable GGUF file ({e})") from e

        def get(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        K = gguf.Keys
        arch = get(K.General.ARCHITECTURE, "")
        return cls(
            architecture=arch,
            context_length=get(K.LLM.CONTEXT_LENGTH.format(arch=arch)),
            tokenizer_model=get(K.Tokenizer.MODEL),
            pre=get(K.Tokenizer.PRE),
            tokens=get(K.Tokenizer.LIST, []),
            token_types=get(K.Tokenizer.TOKEN_TYPE, []),
            merges=get(K.Tokenizer.MERGES, []),
            bos_token_id=get(K.Tokenizer.BOS_ID),
            eos_token_id=get(K.Tokenizer.EOS_ID),
            eot_token_id=get(K.Tokenizer.EOT_ID),
            add_bos_token=bool(get(K.Tokenizer.ADD_BOS, False)),
            add_eos_token=bool(get(K.Tokenizer.ADD_EOS, False)),
            chat_template=get(K.Tokenizer.CHAT_TEMPLATE),
        )

    def token(self, token_id: int | None) -> str | None:
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < len(self.tokens) else None

    def build_tokenizer(self, source: Path) -> Tokenizer:
        """A `tokenizers.Tokenizer` giving the same ids as llama.cpp for byte-level BPE GGUFs."""
        hint = "pass --model-config DIR with the model's tokenizer.json instead"
        if self.tokenizer_model != "gpt2":
            raise ModelResolutionError(
                f"{source}: GGUF tokenizer model {self.tokenizer_model!r} is not supported "
                f"(only byte-level BPE, 'gpt2'); {hint}"
            )
        if self.pre not in _GGUF_PRE_TOKENIZERS:
            raise ModelResolutionError(
                f"{source}: GGUF pre-tokenizer {self.pre!r} is not supported "
                f"(known: {', '.join(_GGUF_PRE_TOKENIZERS)}); {hint}"
            )
        regex, ignore_merges = _GGUF_PRE_TOKENIZERS[self.pre]
        vocab = {t: i for i, t in enumerate(self.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self.merges]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        if regex is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        import gguf

        # llama.cpp matches CONTROL and USER_DEFINED tokens inside text; only CONTROL ones are special.
        control, user = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
        tok.add_tokens(
            [
                AddedToken(t, special=ty == control, normalized=False)
                for t, ty in zip(self.tokens, self.token_types, strict=False)
                if ty in (control, user)
            ]
        )
        tok.post_processor = self._post_processor()
        return tok

    def _post_processor(self) -> processors.PostProcessor:
        specials: list[tuple[str, int]] = []
        bos = self.token(self.bos_token_id) if self.add_bos_token else None
        eos = self.token(self.eos_token_id) if self.add_eos_token else None
        for t, i in ((bos, self.bos_token_id), (eos, self.eos_token_id)):
            if t is not None and i is not None and (t, i) not in specials:
                specials.append((t, i))

        def seq(piece: str) -> str:
            return " ".join(p for p in (bos, piece, eos) if p)

        steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
        if specials:
            steps.append(
                processors.TemplateProcessing(
                    single=seq("$A"), pair=f"{seq('$A')} {seq('$B:1')}", special_tokens=specials
                )
            )
        return processors.Sequence(steps)


@dataclass(eq=False)
class LocalModel:
    """A resolved model: where its files are and what the serving layer needs to know about it."""

    source: str
    kind: ModelKind
    root: Path
    display_name: str
    gguf_path: Path | None = None
    repo_id: str | None = None
    tokenizer_json: Path | None = None
    tokenizer_config_json: Path | None = None
    config_json: Path | None = None
    generation_config_json: Path | None = None
    chat_template: str | None = field(default=None, repr=False)
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    context_length: int | None = None
    gguf_info: GGUFTokenizerInfo | None = field(default=None, repr=False)
    _tokenizer: Tokenizer | None = field(default=None, init=False, repr=False)

    def load_tokenizer(self) -> Tokenizer:
        """tokenizer.json when there is one, else the tokenizer embedded in the GGUF (cached)."""
        if self._tokenizer is None:
            if self.tokenizer_json is not None:
                self._tokenizer = Tokenizer.from_file(str(self.tokenizer_json))
            elif self.gguf_info is not None and self.gguf_path is not None:
                self._tokenizer = self.gguf_info.build_tokenizer(self.gguf_path)
            else:
                raise ModelResolutionError(
                    f"{self.source}: no tokenizer.json found in {self.root}; "
                    "pass --model-config DIR with the model's tokenizer.json"
                )
        return self._tokenizer


def hub_repo_id(spec: str) -> str | None:
    """The hub repo a model spec is spelled as (`hf://org/name`, or `org/name`, which is a hub
    id unless such a relative path exists where it is resolved); None otherwise."""
    if spec.startswith(_HUB_PREFIX):
        return spec[len(_HUB_PREFIX) :]
    return spec if _REPO_ID.match(spec) else None


def resolve_model(
    spec: str, *, model_config: str | Path | None = None, model_name: str | None = None
) -> LocalModel:
    """Turn `spec` (HF folder, .gguf file, `org/name` or `hf://org/name`) into a LocalModel.

    `model_config` is an HF folder whose tokenizer, tokenizer_config, generation_config and chat
    template take precedence over the model's own (dynamo-run's --model-config).
    """
    config_dir = None
    if model_config is not None:
        config_dir = Path(model_config).expanduser()
        if not config_dir.is_dir():
            raise ModelResolutionError(f"--model-config {model_config}: not a directory")

    repo_id = spec[len(_HUB_PREFIX) :] if spec.startswith(_HUB_PREFIX) else None
    path = Path(spec).expanduser()
    if repo_id is None and not path.exists():
        repo_id = hub_repo_id(spec)
        if repo_id is None:
            raise ModelResolutionError(f"model path {spec!r} does not exist (resolved to {path.absolute()})")
    if repo_id is not None:
        path = _hub_snapshot(repo_id)

    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelResolutionError(f"{path}: a model file must be a .gguf; for HF models pass the folder")
        info = GGUFTokenizerInfo.read(path)
        model = LocalModel(
            source=spec,
            kind="gguf",
            root=path.parent,
            gguf_path=path,
            display_name=model_name or path.name.removesuffix(".gguf").removesuffix(".GGUF"),
            gguf_info=info,
        )
        _fill_from_files(model, config_dir, None)
        return model

    if not ((path / "config.json").is_file() or (path / "tokenizer.json").is_file()):
        raise ModelResolutionError(
            f"{path}: not a Hugging Face model folder (it has neither config.json nor tokenizer.json)"
        )
    model = LocalModel(
        source=spec,
        kind="hf",
        root=path,
        repo_id=repo_id,
        display_name=model_name or (repo_id.rsplit("/", 1)[-1] if repo_id else path.resolve().name),
    )
    _fill_from_files(model, config_dir, path)
    return model


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot folder of a hub repo: the HF cache first, then a filtered download."""
    from huggingface_hub import snapshot_download  # slow to import; only hub specs need it

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError) or an invalid/partial cache entry
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:  # offline, no such repo, gated, HTTP errors: all end the same way
        raise ModelResolutionError(
            f"model {repo_id!r}: the Hugging Face hub could not be reached or refused the download, "
            f"and the repo is not in the local cache ({type(e).__name__}: {e}). Fix: download it on a "
            "machine with access (`hf download "
            f"{repo_id}`) and copy the cache over, pass a local model folder or .gguf path instead, "
            "or set HF_HOME to a cache that holds it."
        ) from e


def _read_json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelResolutionError(f"{path}: cannot read JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _first_file(name: str, *dirs: Path | None) -> Path | None:
    for d in dirs:
        if d is not None and (d / name).is_file():
            return d / name
    return None


def _token_content(value: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _template_from(folder: Path) -> str | None:
    """A folder's chat template: tokenizer_config's `chat_template` (a string, or named templates:
    "default", else the first), then chat_template.jinja, then chat_template.json."""
    tpl = _read_json(_first_file("tokenizer_config.json", folder)).get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default", next(iter(named.values()), None))
    if isinstance(tpl, str):
        return tpl
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    tpl = _read_json(_first_file("chat_template.json", folder)).get("chat_template")
    return tpl if isinstance(tpl, str) else None


def _fill_from_files(model: LocalModel, config_dir: Path | None, model_dir: Path | None) -> None:
    """Locate the HF side files (config_dir first) and derive template, specials and context length."""
    model.tokenizer_json = _first_file("tokenizer.json", config_dir, model_dir)
    model.tokenizer_config_json = _first_file("tokenizer_config.json", config_dir, model_dir)
    model.generation_config_json = _first_file("generation_config.json", config_dir, model_dir)
    # An HF model's own config.json describes its weights; a GGUF has none, so take the override's.
    model.config_json = _first_file("config.json", model_dir, config_dir)
    tok_cfg = _read_json(model.tokenizer_config_json)
    gen_cfg = _read_json(model.generation_config_json)
    cfg = _read_json(model.config_json)
    info = model.gguf_info

    # Chat template: the override folder's, then the model folder's, then the GGUF's own.
    templates = (_template_from(d) for d in (config_dir, model_dir) if d is not None)
    model.chat_template = next((t for t in templates if t), None) or (info.chat_template if info else None)

    # Special tokens: token ids by the HF precedence (generation_config, config, tokenizer_config),
    # with the GGUF's own ids last; strings from tokenizer_config, else looked up by id.
    cfg_tokens = {
        _token_content(v): int(k)
        for k, v in tok_cfg.get("added_tokens_decoder", {}).items()
        if isinstance(v, dict) and str(k).isdigit()
    }

    def token_id(content: str | None) -> int | None:
        if content is None:
            return None
        if content in cfg_tokens:
            return cfg_tokens[content]
        return model.load_tokenizer().token_to_id(content) if model.tokenizer_json else None

    bos_str, eos_str = _token_content(tok_cfg.get("bos_token")), _token_content(tok_cfg.get("eos_token"))
    bos_candidates = [*_ids(gen_cfg.get("bos_token_id")), *_ids(cfg.get("bos_token_id"))]
    bos_candidates += _ids(token_id(bos_str))
    eos_ids = [*_ids(gen_cfg.get("eos_token_id")), *_ids(cfg.get("eos_token_id")), *_ids(token_id(eos_str))]
    if info is not None:
        bos_candidates += _ids(info.bos_token_id)
        eos_ids += [*_ids(info.eos_token_id), *_ids(info.eot_token_id)]
    model.bos_token_id = bos_candidates[0] if bos_candidates else None
    model.eos_token_ids = list(dict.fromkeys(eos_ids))
    model.bos_token = bos_str or _token_string(model, model.bos_token_id)
    model.eos_token = eos_str or (
        _token_string(model, model.eos_token_ids[0]) if model.eos_token_ids else None
    )

    # Context length: a GGUF states what its weights were built for; an HF folder says it in config.
    max_len = tok_cfg.get("model_max_length")
    sane_max_len = max_len if isinstance(max_len, int) and 0 < max_len < _SANE_MAX_LENGTH else None
    hf_len = _ids(cfg.get("max_position_embeddings"))[:1] or _ids(sane_max_len)
    gguf_len = _ids(info.context_length) if info is not None else []
    lengths = [*gguf_len, *hf_len]
    model.context_length = lengths[0] if lengths else None


def _token_string(model: LocalModel, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    if model.tokenizer_json is not None:
        return model.load_tokenizer().id_to_token(token_id)
    return model.gguf_info.token(token_id) if model.gguf_info is not None else None
