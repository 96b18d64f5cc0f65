"""The agent's `probe` as preflight runs it on every host (over ssh with the host's python, or
here with ours): model folders, engine packages and API key variables."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_graph.graph.targets.local.remote import agent


def _probe(ask: dict, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", agent.MODULE, "probe"],
        input=json.dumps(ask) + "\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_probe_reports_models_engine_packages_and_env(tmp_path: Path, tiny_model: Path) -> None:
    gguf = next(tiny_model.glob("*.gguf"))
    not_hf = tmp_path / "not-hf"
    not_hf.mkdir()
    (not_hf / "config.json").write_text("{}")
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    ask = {
        "models": [
            [str(tiny_model), None, False],  # an HF folder
            [str(tiny_model), None, True],  # llama.cpp finds its GGUF in it
            [str(gguf), None, True],
            [str(not_hf), str(tokenizer_only), False],  # the tokenizer from --model-config
            [str(not_hf), None, False],
            [str(tokenizer_only), None, True],
            [str(tiny_model / "config.json"), None, False],
            [str(tmp_path / "missing"), None, False],
        ],
        "modules": ["json", "dyngraph_no_such_package", "dyngraph_no_such.child"],
        "env": ["DYNGRAPH_PROBE_SET", "DYNGRAPH_PROBE_EMPTY", "DYNGRAPH_PROBE_UNSET"],
    }
    env = {**os.environ, "DYNGRAPH_PROBE_SET": "k", "DYNGRAPH_PROBE_EMPTY": " "}
    found = _probe(ask, env)
    assert found["models"] == {
        str(not_hf): "is not a Hugging Face model folder: it has no tokenizer.json",
        str(tokenizer_only): "holds no .gguf file, which llama.cpp needs",
        str(tiny_model / "config.json"): "is a file but not a .gguf (give an HF model's folder)",
        str(tmp_path / "missing"): "does not exist",
    }
    assert found["modules_missing"] == ["dyngraph_no_such_package", "dyngraph_no_such.child"]
    assert found["env_unset"] == ["DYNGRAPH_PROBE_EMPTY", "DYNGRAPH_PROBE_UNSET"]
    assert found["gpus"] is None  # not asked


def test_probe_answers_an_old_style_question() -> None:
    """A supervisor of the same major.minor that asks only paths, GPUs and ports still gets its answer."""
    found = _probe({"paths": ["/"], "gpus": False, "ports": []})
    assert found["missing"] == [] and found["models"] == {} and found["modules_missing"] == []


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU machine (nvidia-smi)")
def test_nvidia_smi_and_nvml_count_the_same_gpus() -> None:
    """On a GPU machine (the lead's H100): both counts preflight may use agree, and see a GPU."""
    by_smi, note = agent.gpu_count()
    by_nvml, nvml_note = agent._nvml_gpu_count()
    assert note == "" and nvml_note == ""
    assert by_smi == by_nvml >= 1
