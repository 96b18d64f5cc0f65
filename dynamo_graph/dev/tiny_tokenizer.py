"""Build the tiny model's tokenizer: a byte-level BPE trained locally, Llama-3 style specials.

No model hub is reachable from CI, so tests train a real tokenizer in about a second on text
that every machine of this kind has (the Python stdlib and Debian's licence texts). The output
is byte-identical across runs on the same Python, so token ids in tests are stable.
What the tests use it for: docs/testing.md.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 2048
# Ids 0-5, in this order; <|eot_id|> ends an assistant turn (the chat eos), <|end_of_text|> ends text.
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]
BOS_ID, END_OF_TEXT_ID, EOT_ID, PAD_ID = 0, 1, 4, 5
CORPUS_BYTES = 4_000_000

# A Llama-3 style chat template: system/user/assistant/tool roles, string or list-of-parts
# content, tool definitions and assistant tool calls rendered as JSON.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools is defined and tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou may call these tools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] | trim }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{- call['function']['arguments'] }}"
    "{%- else %}{{- call['function']['arguments'] | tojson }}{%- endif %}"
    "{{- '}' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def _corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / "pydoc_data" / "topics.py"]
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        files += sorted(p for p in licenses.iterdir() if p.is_file())
    files += sorted(stdlib.glob("*.py"))
    return [f for f in files if f.is_file()]


def _corpus() -> Iterator[str]:
    """Yield corpus chunks in a fixed order, capped at CORPUS_BYTES for a fast, stable build."""
    budget = CORPUS_BYTES
    for path in _corpus_files():
        text = path.read_text(encoding="utf-8", errors="replace")[:budget]
        budget -= len(text)
        for start in range(0, len(text), 8192):
            yield text[start : start + 8192]
        if budget <= 0:
            return


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    # As in Llama-3: encoding with special tokens prepends BOS.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
            ),
        ]
    )
    return tok


def write_tokenizer_files(out: Path, context_length: int) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOT_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOT_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return tok
