"""A custom Python worker written against the Dynamo worker API (the "Writing your own engine in
Python" seed): only the import lines differ from Dynamo's.

    python examples/hello_worker.py MODEL_DIR [backend|chat|completion]
    dyngraph run in=http out=auto          # in another shell: the frontend finds the worker

The toy engine answers by echoing: a Backend worker returns the prompt's token ids (the frontend
templates, tokenizes and detokenizes), a Chat worker returns the last user message word by word
as OpenAI chat chunks, a Completion worker returns the prompt as completion chunks.
"""

import asyncio
import sys

import uvloop

from dynamo_graph.llm import ModelType, register_llm
from dynamo_graph.runtime import DistributedRuntime, dynamo_worker

MODEL_TYPES = {"backend": ModelType.Backend, "chat": ModelType.Chat, "completion": ModelType.Completion}


# 1. Decorate a function to get the runtime
#
@dynamo_worker(static=False)
async def worker(runtime: DistributedRuntime, model_path: str, kind: str):
    # 2. Register ourselves on the network
    #
    component = runtime.namespace("hello").component(kind)
    await component.create_service()
    model_type = MODEL_TYPES[kind]
    endpoint = component.endpoint("generate")
    # Optional last param to register_llm is model_name. If not present derives it from model_path
    await register_llm(model_type, endpoint, model_path, f"hello-{kind}")

    # 3. Attach request handler
    #
    handler = RequestHandler(kind)
    await endpoint.serve_endpoint(handler.generate)


class RequestHandler:
    def __init__(self, kind: str):
        self.kind = kind

    async def generate(self, request):
        if self.kind == "backend":
            # A dict with `token_ids` (and stop_conditions, sampling_options, ...): echo the ids.
            limit = (request.get("stop_conditions") or {}).get("max_tokens") or len(request["token_ids"])
            for token_id in request["token_ids"][:limit]:
                yield {"token_ids": [token_id]}
            yield {"token_ids": [], "finish_reason": "stop"}
        elif self.kind == "chat":
            words = request["messages"][-1]["content"].split()
            for i, word in enumerate(words):
                yield {"choices": [{"index": 0, "delta": {"content": word if i == 0 else " " + word}}]}
            yield {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(words), "completion_tokens": len(words)},
            }
        else:
            prompt = request["prompt"]
            for i in range(0, len(prompt), 4):
                yield {"choices": [{"index": 0, "text": prompt[i : i + 4]}]}
            yield {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(worker(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "backend"))
