"""What the multi-node tests share (ssh hosts, Slurm nodes): the Python with torch that runs the
ranks of examples/tp_engine.py, and the greedy request whose answer a two-rank replica must
give exactly as a one-rank worker does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
TORCH_VENV = Path(os.environ.get("DYNGRAPH_VLLM_VENV", ROOT / ".venv-vllm"))  # make vllm
TP_ENGINE = str(ROOT / "examples" / "tp_engine.py")
START_S = {TP_ENGINE: 120, "vllm": 400}  # vLLM's own start on two shared cores takes minutes


def rank_worker(engine: str) -> dict[str, Any]:
    """A worker component of `engine` (TP_ENGINE or vllm) for a multi-node test graph, without
    its model, placement and sizes: vLLM small (1 GiB of KV cache, 256 tokens of context) and
    given minutes to start."""
    worker: dict[str, Any] = {
        "kind": "worker",
        "engine": engine,
        "restart": {"backoff_s": 0.2},
        "readiness": {"timeout_s": START_S[engine]},
    }
    if engine == "vllm":
        worker |= {"env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "engine_args": {"max_model_len": 256}}
    return worker


def missing_torch() -> str | None:
    """Why the ranks cannot run here, or None."""
    if not (TORCH_VENV / "bin" / "python").exists():
        return f"no venv with torch at {TORCH_VENV} (DYNGRAPH_VLLM_VENV)"
    return None


def greedy_chat(port: int, model: str) -> str:
    """Eight greedy tokens of the official client's chat completion (EOS ignored)."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=20)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the same greedy tokens"}],
        max_tokens=8,
        temperature=0,
        extra_body={"nvext": {"ignore_eos": True}},
    )
    return reply.choices[0].message.content or ""


def answers(port: int, model: str) -> bool:
    """The model answers now (any error: not yet)."""
    try:
        return bool(greedy_chat(port, model))
    except Exception:
        return False
