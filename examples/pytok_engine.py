"""A dynamo-run python engine file, tokens in and out:

    dyngraph run in=http out=pytok:examples/pytok_engine.py --model-path MODEL_DIR -- --repeat 2

The frontend templates and tokenizes; `generate` gets the token request as a dict
(token_ids, stop_conditions, sampling_options, eos_token_ids, ...) and yields {"token_ids": [...]}
chunks, here the prompt's last words again. The file is loaded once, as __main__, with sys.argv
holding dynamo-run's flags and whatever follows `--`.
"""

import argparse
import asyncio
import sys

parser = argparse.ArgumentParser(add_help=False)
parser.add_argument("--repeat", type=int, default=1)
ARGS, _ = parser.parse_known_args(sys.argv[1:])


async def generate(request):
    eos = set(request["eos_token_ids"] or [])
    tail = [t for t in request["token_ids"] if t not in eos][-16:]
    for _ in range(ARGS.repeat):
        for token_id in tail:
            await asyncio.sleep(0.001)
            yield {"token_ids": [token_id]}
    yield {"token_ids": [], "finish_reason": "stop"}
