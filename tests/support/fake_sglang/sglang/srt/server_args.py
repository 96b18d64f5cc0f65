"""The ServerArgs fields our adapter passes (it checks its keys against the dataclass's fields)."""

from __future__ import annotations

from dataclasses import make_dataclass
from typing import Any

_FIELDS = """model_path skip_tokenizer_init tp_size base_gpu_id page_size context_length nnodes node_rank
dist_init_addr kv_events_config incremental_streaming_output disaggregation_mode
disaggregation_transfer_backend disaggregation_bootstrap_port host"""

ServerArgs = make_dataclass("ServerArgs", [(name, Any, None) for name in _FIELDS.split()])
