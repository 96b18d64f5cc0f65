"""The embeddings request and response, as OpenAI defines them.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; its
shape is checked by the pipeline (llm/embeddings.py), since msgspec cannot tell list types apart
in a union. `encoding_format: base64` sends each vector as little-endian float32 bytes in base64
(what the official client asks for by default and decodes with numpy).
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from dynamo_graph.llm.embeddings import MAX_INPUTS

_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# The shapes llm/embeddings.py takes (msgspec cannot tell list types apart in a union).
INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_INPUTS},
        {**_IDS, "maxItems": MAX_INPUTS},
        {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_INPUTS},
    ]
}


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    stream: ClassVar[bool] = False  # an embeddings answer is always whole (one JSON body)

    model: str
    input: Annotated[str | list[Any], Meta(extra_json_schema={"allOf": [INPUT_SCHEMA]})]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


def _base64(vector: list[float]) -> str:
    packed = array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def embeddings_body(model: str, vectors: list[list[float]], prompt_tokens: int, encoding: str) -> bytes:
    """The whole response: one `embedding` object per input, in input order."""
    encode = _base64 if encoding == "base64" else None
    data = [
        {"object": "embedding", "index": i, "embedding": encode(v) if encode else v}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return msgspec.json.encode({"object": "list", "data": data, "model": model, "usage": usage})
