"""The ServerArgs fields our adapter passes (it checks its keys against these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerArgs:
    model_path: str = ""
    skip_tokenizer_init: bool = False
    tp_size: int = 1
    base_gpu_id: int = 0
    page_size: int = 1
    context_length: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    kv_events_config: str | None = None
    incremental_streaming_output: bool = False
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
