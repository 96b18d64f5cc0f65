"""A pytok engine file that answers like an agent model, in one tool-call format:

    AGENT_FORMAT=hermes [AGENT_THINK=qwen3|deepseek_r1] dyngraph run in=http \
        out=pytok:tests/support/scripts/agent_engine.py --model-path TINY --dyn-tool-call-parser hermes

It reads the real prompt (the tiny model's chat template, decoded with its tokenizer): while the
conversation has no tool result yet, it calls the first offered tool, with the tool's first
parameter set to the user's last message, written in the format's own markup after a short
preamble (formats that allow one); once a tool result is in the prompt, it answers with that
result. `--think` puts a thinking section before the answer, as that reasoning parser expects.
The answer is encoded with the model's tokenizer and streamed a token a chunk, so the frontend's
parsers see markup split wherever the tokenizer splits it.
"""

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path

from tokenizers import Tokenizer

parser = argparse.ArgumentParser(add_help=False)
parser.add_argument("--model-path", required=True)
ARGS, _ = parser.parse_known_args(sys.argv[1:])
FORMAT = os.environ["AGENT_FORMAT"]
THINK = os.environ.get("AGENT_THINK")
TOKENIZER = Tokenizer.from_file(str(Path(ARGS.model_path) / "tokenizer.json"))
HEADER = re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S)
PREAMBLE = "Let me look that up.\n"


def tool_call(name: str, args: dict) -> str:
    body = json.dumps(args)
    if FORMAT == "hermes":
        return PREAMBLE + f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>'
    if FORMAT == "llama3_json":
        return f'<|python_tag|>{{"name": "{name}", "parameters": {body}}}'
    if FORMAT == "mistral":
        return PREAMBLE + f'[TOOL_CALLS][{{"name": "{name}", "arguments": {body}}}]'
    if FORMAT == "pythonic":
        kwargs = ", ".join(f"{k}={v!r}" for k, v in args.items())
        return f"[{name}({kwargs})]"
    if FORMAT == "deepseek_v3":
        return (
            PREAMBLE + "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            f"{name}\n```json\n{body}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        )
    raise ValueError(f"unknown format {FORMAT}")


def answer(prompt: str) -> str:
    turns = HEADER.findall(prompt)
    tools = [json.loads(line) for line in turns[0][1].splitlines()[1:]] if turns[0][0] == "system" else []
    results = [text for role, text in turns if role == "tool"]
    if results or not tools:
        reply = f"The tool says: {results[-1]}" if results else "No tools, no answer."
    else:
        function = tools[0]["function"]
        first_param = next(iter(function["parameters"]["properties"]))
        user = [text for role, text in turns if role == "user"][-1]
        reply = tool_call(function["name"], {first_param: user})
    if THINK == "qwen3":
        return f"<think>\nThe user wants {len(prompt)} characters of help.\n</think>\n\n{reply}"
    if THINK == "deepseek_r1":
        return f"The user wants {len(prompt)} characters of help.\n</think>\n\n{reply}"
    return reply


async def generate(request):
    prompt = TOKENIZER.decode(request["token_ids"], skip_special_tokens=False)
    for token_id in TOKENIZER.encode(answer(prompt), add_special_tokens=False).ids:
        await asyncio.sleep(0)
        yield {"token_ids": [token_id]}
    yield {"token_ids": [], "finish_reason": "stop"}
