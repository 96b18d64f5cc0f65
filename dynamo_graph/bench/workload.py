"""Workloads: the prompts, output lengths and arrival times a benchmark sends.

Three kinds, all seeded and so the same for every variant of a sweep (measure.py draws each
load point's own, from the seed and the point's index, unless asked to reuse them):
- synthetic: `input_len` prompt tokens and `output_len` tokens to generate per request;
- shared prefix: the same, but each prompt starts with one of `num_prefixes` common prefixes of
  `prefix_len` tokens (what a prefix cache and KV-aware routing are for);
- a JSONL trace in Dynamo's mooncake format, one request a line:
  `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [..]}` where equal hash
  ids are equal blocks of `block_size` (512) prompt tokens, so the trace's prefix sharing is kept.

With the model's tokenizer, prompts are token ids from its ordinary vocabulary (above its special
tokens), sent as such to /v1/completions: exactly `input_len` tokens reach the engine. For the
chat API they are decoded to text (the template and re-tokenizing make the count approximate;
the usage the server returns says what it was). Without a tokenizer, prompts are plain words,
about one token each.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dynamo_graph.bench.loadgen import Request

MOONCAKE_BLOCK_SIZE = 512
# Words for prompts when the tokenizer is unknown (about one token each in most vocabularies).
_WORDS = tuple(
    " ".join(
        (
            "time year people way day man thing woman life child world school state family student",
            "group country problem hand part place case week company system program question work",
            "government number night point home water room mother area money story fact month lot right",
            "study book eye job word business issue side kind head house service friend father power",
            "hour game line",
        )
    ).split()
)


class WorkloadError(ValueError):
    """A workload that cannot be built (bad trace line, impossible lengths); names the cause."""


@dataclass(frozen=True)
class Prompt:
    """A request before it becomes a body: its prompt tokens, output length and arrival time."""

    ids: list[int]
    max_tokens: int
    at: float = 0.0


class Vocabulary:
    """Turns token ids into what is sent: ids as they are, or text for the chat API."""

    def __init__(self, low: int, high: int, decode: Callable[[list[int]], str] | None) -> None:
        if high <= low:
            raise WorkloadError(f"the tokenizer has no ordinary tokens to draw from ({low}..{high})")
        self.low, self.high, self._decode = low, high, decode

    @property
    def exact(self) -> bool:
        """Whether prompts are real token ids of the served model."""
        return self._decode is not None

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.low, self.high) for _ in range(n)]

    def text(self, ids: list[int]) -> str:
        if self._decode is None:
            return " ".join(_WORDS[i % len(_WORDS)] for i in ids)
        return self._decode(ids)


def words_vocabulary() -> Vocabulary:
    """No tokenizer: prompts of plain words, about one token each."""
    return Vocabulary(0, len(_WORDS), None)


def tokenizer_vocabulary(model_dir: Path) -> Vocabulary:
    """The ordinary ids of the tokenizer in a Hugging Face folder (its tokenizer.json)."""
    from tokenizers import Tokenizer

    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise WorkloadError(f"{model_dir}: no tokenizer.json (give --tokenizer a Hugging Face model folder)")
    low, high = vocab_range(model_dir)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return Vocabulary(low, high, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def vocab_range(model_dir: Path) -> tuple[int, int]:
    """[low, high): the model's ordinary token ids, above its added and special tokens."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    size = len(tok["model"]["vocab"])
    config = model_dir / "config.json"
    if config.exists():
        size = min(size, json.loads(config.read_text()).get("vocab_size", size))
    special = [t["id"] for t in tok.get("added_tokens", []) if t["id"] < size]
    return (max(special) + 1 if special else 0), size


def synthetic(
    vocab: Vocabulary,
    *,
    count: int,
    input_len: int,
    output_len: int,
    prefix_len: int = 0,
    num_prefixes: int = 1,
    seed: int | str = 0,
) -> list[Prompt]:
    """`count` prompts of `input_len` tokens; with `prefix_len`, each begins with one of
    `num_prefixes` shared prefixes (request i uses prefix i mod num_prefixes)."""
    if input_len < 1 or output_len < 1 or count < 1:
        raise WorkloadError("input and output lengths and the request count must be at least 1")
    if not 0 <= prefix_len <= input_len:
        raise WorkloadError(f"the prefix length ({prefix_len}) must be within the input length ({input_len})")
    if num_prefixes < 1:
        raise WorkloadError("the number of prefixes must be at least 1")
    rng = random.Random(seed)
    prefixes = [vocab.draw(rng, prefix_len) for _ in range(num_prefixes)]
    return [
        Prompt(prefixes[i % num_prefixes] + vocab.draw(rng, input_len - prefix_len), output_len)
        for i in range(count)
    ]


def trace(
    vocab: Vocabulary,
    path: Path,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    speedup: float = 1.0,
    limit: int | None = None,
    seed: int | str = 0,
) -> list[Prompt]:
    """The requests of a mooncake-style JSONL trace, arriving at `timestamp / speedup`
    (milliseconds, counted from the first line's)."""
    blocks: dict[int, list[int]] = {}
    prompts: list[Prompt] = []
    first: float | None = None
    rng = random.Random(seed)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if limit is not None and len(prompts) >= limit:
            break
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
            stamp = float(row.get("timestamp", 0))
            input_len = int(row["input_length"])
            output_len = int(row["output_length"])
            hash_ids = [int(h) for h in row.get("hash_ids") or []]
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"{where}: not a trace line ({type(e).__name__}: {e})") from None
        if input_len < 1 or output_len < 1 or not math.isfinite(stamp):
            raise WorkloadError(f"{where}: input_length and output_length must be at least 1")
        ids: list[int] = []
        for h in hash_ids:
            if h not in blocks:
                blocks[h] = vocab.draw(random.Random(f"{seed}:{h}"), block_size)
            ids += blocks[h]
        ids = ids[:input_len] + vocab.draw(rng, max(0, input_len - len(ids)))
        first = stamp if first is None else first
        prompts.append(Prompt(ids, output_len, at=(stamp - first) / 1000.0 / speedup))
    if not prompts:
        raise WorkloadError(f"{path}: no requests in the trace")
    return prompts


def digest(prompts: list[Prompt]) -> str:
    """A short fingerprint of the prompts' ids and lengths: equal for the same prompts."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.ids, p.max_tokens]).encode())
    return h.hexdigest()[:16]


def poisson(prompts: list[Prompt], rate: float, seed: int = 0) -> list[Prompt]:
    """The same prompts arriving as a Poisson process of `rate` requests per second."""
    rng = random.Random(f"{seed}:arrivals")
    at, out = 0.0, []
    for p in prompts:
        out.append(Prompt(p.ids, p.max_tokens, at))
        at += rng.expovariate(rate)
    return out


def scheduled(prompts: list[Prompt], times: list[float]) -> list[Prompt]:
    """The same prompts sent at the given times (a load profile's arrivals)."""
    return [Prompt(p.ids, p.max_tokens, at) for p, at in zip(prompts, times, strict=True)]


def to_requests(
    prompts: list[Prompt], vocab: Vocabulary, *, api: str, model: str, ignore_eos: bool
) -> list[Request]:
    """Request bodies for `/v1/completions` (token ids when the vocabulary is the model's) or
    `/v1/chat/completions` (text), streamed with usage in the last chunk."""
    requests = []
    for p in prompts:
        body: dict = {
            "model": model,
            "max_tokens": p.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:  # the output lengths are the workload's, not the model's
            body["ignore_eos"] = True
        if api == "chat":
            body["messages"] = [{"role": "user", "content": vocab.text(p.ids)}]
        else:
            body["prompt"] = p.ids if vocab.exact else vocab.text(p.ids)
        requests.append(Request(body, p.at))
    return requests
