"""A tensor-parallel engine over torch.distributed (gloo): one replica's ranks on several nodes.

    # in a graph: `engine: ../examples/tp_engine.py`, `nodes: 2`, `gpus: {tensor_parallel_size: 2}`
    dyngraph run in=dyn://ns.tp.generate out=examples/tp_engine.py --model-path MODEL_DIR \\
        --num-nodes 2 --node-rank R --leader-addr HOST:PORT

What a multi-node replica needs of an engine, small enough to read: every rank is given
`--num-nodes`, its `--node-rank` and the leader's `--leader-addr` (the graph compiler allocates
that port on the leader's host); the ranks meet there (`init_process_group`), each holds its
shard of the model's weights, and every step is a collective. Rank 0 (the leader) serves the
endpoint and broadcasts each step's tokens; the others only follow (backend/worker.py
`follow_leader`). The "model" is a two-layer MLP over the model folder's vocabulary with seeded
weights (float64): its hidden layer is split by column over the ranks and the output layer by
row, so the logits are the sum (all-reduce) of the ranks' partial ones, and its greedy tokens
equal the one-rank run's. Not a language model: it shows the rendezvous, the sharding and the
gang, not text quality. Needs torch in the worker's Python (the vLLM venv has it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import EngineSettings
from dynamo_graph.llm.model_source import LocalModel
from dynamo_graph.runtime.context import Context

log = logging.getLogger("tp_engine")
HIDDEN = 64  # embedding width
FFN = 256  # hidden units, split evenly over the ranks
SEED = 1234
STOP = -1  # the length the leader broadcasts to end the followers' loop


class TensorParallelEngine(LLMEngine):
    def __init__(self, vocab: int, world: int, rank: int, leader: str | None) -> None:
        import torch
        import torch.distributed as dist

        if FFN % world:
            raise ValueError(f"tp_engine.py: {FFN} hidden units do not split over {world} ranks")
        self.torch, self.dist = torch, dist
        self.world, self.rank, self.leader = world, rank, leader
        gen = torch.Generator().manual_seed(SEED)  # every rank draws the same full weights
        self.embed = torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64)
        w1 = torch.randn(HIDDEN, FFN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
        w2 = torch.randn(FFN, vocab, generator=gen, dtype=torch.float64) / FFN**0.5
        part = FFN // world
        self.w1 = w1[:, rank * part : (rank + 1) * part].contiguous()  # column-parallel
        self.w2 = w2[rank * part : (rank + 1) * part].contiguous()  # row-parallel
        self.lock = asyncio.Lock()
        self.follower: threading.Thread | None = None

    @classmethod
    def from_config(cls, settings: EngineSettings, model: LocalModel | None) -> TensorParallelEngine:
        vocab = 2048
        if model is not None and model.config_json is not None:
            vocab = int(json.loads(Path(model.config_json).read_text())["vocab_size"])
        return cls(vocab, settings.num_nodes, settings.node_rank, settings.leader_addr)

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self.world > 1:
            await asyncio.to_thread(self._join)
            log.info("tp_engine: rank %d of %d joined tcp://%s", self.rank, self.world, self.leader)
        if self.rank > 0:
            self.follower = threading.Thread(target=self._follow, name="tp-follower", daemon=True)
            self.follower.start()
        return EngineConfig(model_input="tokens")

    def _join(self) -> None:
        # gloo binds the interface the worker chose (GLOO_SOCKET_IFNAME: backend/rank_network.py)
        self.dist.init_process_group(
            "gloo", init_method=f"tcp://{self.leader}", rank=self.rank, world_size=self.world
        )

    def _logits(self, ids: Any) -> Any:
        """This rank's partial logits, summed over the ranks."""
        hidden = self.torch.tanh(self.embed[ids].mean(dim=0) @ self.w1)
        logits = hidden @ self.w2
        if self.world > 1:
            self.dist.all_reduce(logits)
        return logits

    def _step(self, tokens: list[int]) -> int:
        """The leader's greedy step: the tokens go to every rank, the logits come back summed."""
        ids = self.torch.tensor(tokens, dtype=self.torch.int64)
        if self.world > 1:
            self.dist.broadcast(self.torch.tensor([len(tokens)]), src=0)
            self.dist.broadcast(ids, src=0)
        return int(self._logits(ids).argmax())

    def _follow(self) -> None:
        """A follower's work: each step the leader broadcasts; it exits the process when the
        leader is gone (the supervisor restarts the group)."""
        torch = self.torch
        try:
            while True:
                size = torch.zeros(1, dtype=torch.int64)
                self.dist.broadcast(size, src=0)
                if int(size) == STOP:
                    return
                ids = torch.zeros(int(size), dtype=torch.int64)
                self.dist.broadcast(ids, src=0)
                self._logits(ids)
        except Exception as e:  # the leader died mid-collective: this rank is of no use alone
            log.error("tp_engine: lost the leader (%s); exiting", e)
            os._exit(1)

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        limit = request.stop_conditions.max_tokens or 16
        eos = set(request.eos_token_ids)
        tokens, sent, reason = list(request.token_ids), 0, "length"
        async with self.lock:  # one step at a time: every rank takes part in each
            while sent < limit:
                if context.is_stopped():
                    reason = "cancelled"
                    break
                token = await asyncio.to_thread(self._step, tokens)
                if token in eos and not request.stop_conditions.ignore_eos:
                    reason = "eos"
                    break
                yield LLMEngineOutput(token_ids=[token])
                tokens.append(token)
                sent += 1
        usage = CompletionUsage(prompt_tokens=len(request.token_ids), completion_tokens=sent)
        yield LLMEngineOutput(finish_reason=reason, completion_usage=usage)  # type: ignore[arg-type]

    async def cleanup(self) -> None:
        if self.world > 1 and self.rank == 0 and self.dist.is_initialized():
            try:  # followers leave their loop; a dead one makes this fail, which is fine now
                await asyncio.wait_for(
                    asyncio.to_thread(self.dist.broadcast, self.torch.tensor([STOP]), 0), 5.0
                )
            except Exception as e:
                log.info("tp_engine: could not tell the followers to stop: %s", e)
