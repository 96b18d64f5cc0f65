"""Model resolution on real files: the tiny model's HF folder, its GGUF, and hub specs offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

import dynamo_graph
from dynamo_graph.dev.tiny_model import GGUF_NAME
from dynamo_graph.dev.tiny_tokenizer import CHAT_TEMPLATE
from dynamo_graph.llm.model_source import ModelResolutionError, resolve_model

REPO_ROOT = Path(dynamo_graph.__file__).resolve().parents[1]
HF_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
TRICKY = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "emoji 🤖🎉👩‍👩‍👧 mixed",
    "CJK 你好，世界 and かな カナ 한국어",
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
    "specials glued:x<|eot_id|>y<|begin_of_text|>z",
    "it's we'll they'd 12345 3.14159 $100",
    "",
]


def _copy_hf(src: Path, dst: Path, names: list[str] = HF_FILES) -> Path:
    dst.mkdir(parents=True)
    for n in names:
        shutil.copy(src / n, dst / n)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def test_hf_folder(tiny_model: Path) -> None:
    m = resolve_model(str(tiny_model))
    assert (m.kind, m.root, m.gguf_path, m.repo_id) == ("hf", tiny_model, None, None)
    assert m.display_name == tiny_model.name
    assert m.config_json == tiny_model / "config.json"
    assert m.tokenizer_json == tiny_model / "tokenizer.json"
    assert m.tokenizer_config_json == tiny_model / "tokenizer_config.json"
    assert m.generation_config_json == tiny_model / "generation_config.json"
    assert m.chat_template == CHAT_TEMPLATE
    assert (m.bos_token, m.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert (m.bos_token_id, m.eos_token_ids) == (0, [4, 1])
    assert m.context_length == 512
    tok = m.load_tokenizer()
    assert tok is m.load_tokenizer()
    assert tok.encode("Hi").ids[0] == 0


def test_model_name_overrides_display_name(tiny_model: Path) -> None:
    assert resolve_model(str(tiny_model), model_name="served").display_name == "served"
    assert resolve_model(str(tiny_model / GGUF_NAME), model_name="g").display_name == "g"


def test_gguf_file(tiny_model: Path) -> None:
    m = resolve_model(str(tiny_model / GGUF_NAME))
    assert (m.kind, m.root, m.gguf_path) == ("gguf", tiny_model, tiny_model / GGUF_NAME)
    assert m.display_name == "tiny-llama-f32"
    # A GGUF alone has no HF side files, even when they happen to lie beside it.
    assert (m.tokenizer_json, m.tokenizer_config_json, m.config_json, m.generation_config_json) == (None,) * 4
    assert m.chat_template == CHAT_TEMPLATE
    assert (m.bos_token, m.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert (m.bos_token_id, m.eos_token_ids) == (0, [4])
    assert m.context_length == 512


@pytest.mark.parametrize("text", TRICKY)
def test_gguf_tokenizer_matches_tokenizer_json(tiny_model: Path, text: str) -> None:
    hf = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ours = resolve_model(str(tiny_model / GGUF_NAME)).load_tokenizer()
    for special in (True, False):
        assert (
            ours.encode(text, add_special_tokens=special).ids
            == hf.encode(text, add_special_tokens=special).ids
        )
    ids = hf.encode(text).ids
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_gguf_with_model_config(tiny_model: Path, tmp_path: Path) -> None:
    cfg = _copy_hf(tiny_model, tmp_path / "cfg")
    _edit_json(cfg / "tokenizer_config.json", chat_template="OVERRIDE {{ messages }}")
    m = resolve_model(str(tiny_model / GGUF_NAME), model_config=cfg)
    assert m.kind == "gguf" and m.gguf_path == tiny_model / GGUF_NAME
    assert m.tokenizer_json == cfg / "tokenizer.json"
    assert m.tokenizer_config_json == cfg / "tokenizer_config.json"
    assert m.generation_config_json == cfg / "generation_config.json"
    assert m.config_json == cfg / "config.json"
    assert m.chat_template == "OVERRIDE {{ messages }}"
    assert m.eos_token_ids == [4, 1]
    assert m.context_length == 512
    assert m.load_tokenizer().encode("x<|eot_id|>").ids == [0, 93, 4]


def test_hf_folder_with_model_config(tiny_model: Path, tmp_path: Path) -> None:
    cfg = _copy_hf(tiny_model, tmp_path / "cfg", ["tokenizer_config.json"])
    _edit_json(cfg / "tokenizer_config.json", chat_template="CFG")
    m = resolve_model(str(tiny_model), model_config=cfg)
    assert m.chat_template == "CFG"
    assert m.tokenizer_config_json == cfg / "tokenizer_config.json"
    assert m.tokenizer_json == tiny_model / "tokenizer.json"  # not in the override: the model's own
    assert m.config_json == tiny_model / "config.json"


def test_chat_template_sources(tiny_model: Path, tmp_path: Path) -> None:
    d = _copy_hf(tiny_model, tmp_path / "m")
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    _edit_json(d / "tokenizer_config.json", chat_template=named)
    assert resolve_model(str(d)).chat_template == "DEFAULT"
    _edit_json(d / "tokenizer_config.json", chat_template=None)
    assert resolve_model(str(d)).chat_template is None
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "FROM JSON"}))
    assert resolve_model(str(d)).chat_template == "FROM JSON"
    (d / "chat_template.jinja").write_text("FROM JINJA")
    assert resolve_model(str(d)).chat_template == "FROM JINJA"
    _edit_json(d / "tokenizer_config.json", chat_template="INLINE")
    assert resolve_model(str(d)).chat_template == "INLINE"


def test_eos_ids_are_the_ordered_union(tiny_model: Path, tmp_path: Path) -> None:
    d = _copy_hf(tiny_model, tmp_path / "m")
    _edit_json(d / "generation_config.json", eos_token_id=1)
    _edit_json(d / "config.json", eos_token_id=[2, 1])
    m = resolve_model(str(d))
    assert m.eos_token_ids == [1, 2, 4]  # generation_config, config, then tokenizer_config's <|eot_id|>
    assert m.eos_token == "<|eot_id|>"
    (d / "generation_config.json").unlink()
    _edit_json(d / "config.json", eos_token_id=None, bos_token_id=None)
    _edit_json(d / "tokenizer_config.json", eos_token={"content": "<|end_of_text|>"})
    m = resolve_model(str(d))
    assert (m.eos_token_ids, m.eos_token, m.bos_token_id) == ([1], "<|end_of_text|>", 0)


def test_context_length_fallbacks(tiny_model: Path, tmp_path: Path) -> None:
    d = _copy_hf(tiny_model, tmp_path / "m")
    _edit_json(d / "config.json", max_position_embeddings=None)
    _edit_json(d / "tokenizer_config.json", model_max_length=300)
    assert resolve_model(str(d)).context_length == 300
    _edit_json(d / "tokenizer_config.json", model_max_length=int(1e30))  # transformers' "no limit"
    assert resolve_model(str(d)).context_length is None


def test_folder_without_tokenizer_json(tiny_model: Path, tmp_path: Path) -> None:
    d = _copy_hf(tiny_model, tmp_path / "m", ["config.json", "generation_config.json"])
    m = resolve_model(str(d))  # engines that read tokenizer.model themselves can still use it
    assert (m.tokenizer_json, m.eos_token_ids, m.bos_token_id, m.bos_token) == (None, [4, 1], 0, None)
    with pytest.raises(ModelResolutionError, match="--model-config"):
        m.load_tokenizer()
    assert resolve_model(str(d), model_config=tiny_model).load_tokenizer().encode("Hi").ids[0] == 0


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelResolutionError, match="does not exist") as e:
        resolve_model(str(missing))
    assert str(missing) in str(e.value)


def test_not_a_model_folder_or_file(tmp_path: Path) -> None:
    with pytest.raises(ModelResolutionError, match=r"neither config\.json nor tokenizer\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelResolutionError, match=r"must be a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelResolutionError, match="not a readable GGUF"):
        resolve_model(str(tmp_path / "broken.gguf"))


def test_unsupported_gguf_tokenizer_suggests_model_config(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(128)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "▁a"])
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, 1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = resolve_model(str(path))
    assert m.context_length == 128
    with pytest.raises(ModelResolutionError, match=r"'llama' is not supported.*--model-config"):
        m.load_tokenizer()
    fixed = resolve_model(str(path), model_config=tiny_model)
    assert fixed.load_tokenizer().encode("Hi").ids[0] == 0


def _resolve_in_subprocess(spec: str, hf_home: Path) -> subprocess.CompletedProcess[str]:
    """huggingface_hub reads HF_HOME / HF_HUB_OFFLINE at import, so hub cases run in a fresh process."""
    code = (
        "import json, sys\n"
        "from dynamo_graph.llm.model_source import ModelResolutionError, resolve_model\n"
        "try:\n"
        "    m = resolve_model(sys.argv[1])\n"
        "except ModelResolutionError as e:\n"
        "    sys.exit(str(e))\n"
        "print(json.dumps({'kind': m.kind, 'root': str(m.root), 'name': m.display_name,\n"
        "                  'repo': m.repo_id, 'eos': m.eos_token_ids}))\n"
    )
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", code, spec], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("spec", ["acme/tiny-chat", "hf://acme/tiny-chat"])
def test_hub_repo_offline_names_the_repo_and_the_fix(tmp_path: Path, spec: str) -> None:
    r = _resolve_in_subprocess(spec, tmp_path / "hf-home")
    assert r.returncode != 0
    assert "'acme/tiny-chat'" in r.stderr
    assert "could not be reached" in r.stderr and "not in the local cache" in r.stderr
    assert "HF_HOME" in r.stderr and "local model folder" in r.stderr


def test_hub_repo_from_local_cache(tiny_model: Path, tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-home" / "hub" / "models--acme--tiny-chat"
    _copy_hf(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    r = _resolve_in_subprocess("hf://acme/tiny-chat", tmp_path / "hf-home")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {
        "kind": "hf",
        "root": str(repo / "snapshots" / commit),
        "name": "tiny-chat",
        "repo": "acme/tiny-chat",
        "eos": [4, 1],
    }
