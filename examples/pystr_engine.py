"""A dynamo-run python engine file, OpenAI chat in and out (it does its own "templating"):

    dyngraph run in=http out=pystr:examples/pystr_engine.py --model-name shout

`generate` gets the chat completion request as a dict and yields chat.completion.chunk dicts:
here the last user message, upper-cased, word by word.
"""

import asyncio


async def generate(request):
    words = str(request["messages"][-1].get("content") or "").split()
    limit = request.get("max_completion_tokens") or request.get("max_tokens") or len(words)
    sent = 0
    for word in words[:limit]:
        await asyncio.sleep(0.001)
        text = word.upper() if sent == 0 else " " + word.upper()
        yield {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
        sent += 1
    finish = "length" if sent < len(words) else "stop"
    yield {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
        "usage": {"prompt_tokens": len(words), "completion_tokens": sent},
    }
