"""The router's settings (the kv router's and disaggregation's), declared once
(dynamo_graph/options.py derives the rest from them).

`dyngraph run`'s `--router-*` flags, a graph frontend's `router:` section and the kv router
itself (router/kv/router.py) all read `RouterConfig`; its `check` is the one place the rules
that span settings live, worded with whatever names the caller spells settings by (flags or
graph keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dynamo_graph.options import SettingError, Spell, setting
from dynamo_graph.runtime.traffic import parse_labels

# Settings that mean something only to the kv router: given with another mode, an error.
KV_ONLY = (
    "session_affinity_ttl_secs",
    "session_affinity_mode",
    "queue_threshold",
    "queue_policy",
    "max_queue_size",
    "queue_reserve",
)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the frontend picks a worker instance."""

    mode: Literal["random", "round-robin", "kv"] = setting("round-robin", flag="--router-mode")
    """`kv` routes by KV cache overlap and needs KV events (or `use_kv_events: false`)."""
    kv_overlap_score_weight: float = setting(
        1.0, flag="--kv-overlap-score-weight", ge=0, dynamo="--router-prefill-load-scale"
    )
    """kv: weight of cached-prefix overlap against load."""
    temperature: float = setting(0.0, flag="--router-temperature", ge=0, dynamo="--router-temperature")
    """kv: softmax temperature of the pick, 0 = always the best."""
    use_kv_events: bool = setting(True, flag="--use-kv-events", bool_word=True)
    """kv: follow workers' KV events; false predicts cache contents from routed requests."""
    cost: Literal["predictive", "dynamo"] = setting("predictive", flag="--router-cost")
    """kv: `predictive` sends a request where its time to first token is predicted lowest (a
    per-worker prefill cost fitted from observed TTFTs); `dynamo` uses Dynamo's block cost."""
    prefill_penalty: float = setting(1.0, flag="--router-prefill-penalty", ge=0)
    """kv, predictive cost: besides its own predicted wait, a request is charged this many times
    the prefill time of the work it adds on a worker: its uncached tokens (a wait for those
    queued behind it) and the cached blocks they evict there; 0 = its own TTFT only."""
    session_affinity_ttl_secs: float = setting(
        0.0, flag="--router-session-affinity-ttl-secs", ge=0, dynamo="--router-session-affinity-ttl-secs"
    )
    """kv: keep a session's requests (`x-session-id` header or `nvext.agent_context.session_id`)
    on one worker for this many seconds after its last request; 0 = off."""
    session_affinity_mode: Literal["hard", "soft"] = setting(
        "soft", flag="--router-session-affinity-mode", dynamo="--router-session-affinity-mode"
    )
    """kv: `soft` lets a session move when its worker's predicted TTFT is clearly worse; `hard`
    never."""
    queue_threshold: float | None = setting(
        None, flag="--router-queue-threshold", ge=0, dynamo="--router-queue-threshold"
    )
    """kv: hold requests at the frontend while every worker has more prompt tokens waiting
    than this fraction of its max_num_batched_tokens (as Dynamo's; 0: as soon as every worker
    has any); default: never."""
    queue_policy: Literal["priority", "fcfs", "wspt"] = setting(
        "priority", flag="--router-queue-policy", dynamo="--router-queue-policy"
    )
    """kv: order of the held requests: highest `x-dynamo-request-priority` /
    `nvext.agent_hints.priority` first, first come first served, or Dynamo's weighted shortest
    processing time, (1 + priority) / uncached prompt tokens."""
    max_queue_size: int = setting(1024, flag="--router-max-queue-size", ge=0)
    """kv: held requests at most; more are answered 529 (503 with
    DYN_HTTP_OVERLOAD_STATUS_CODE=503) with Retry-After."""
    queue_reserve: int = setting(0, flag="--router-queue-reserve", ge=0)
    """kv, with the queue in priority order: workers kept free of ordinary prefill work while
    priority > 0 requests are arriving, so that they start at once; 0: none."""
    instance_labels: str | None = setting(None, flag="--router-instance-labels")
    """Route only to worker instances labelled so (`key=value[,key=value]`, from the workers'
    DYN_INSTANCE_LABELS; every worker of a graph carries `revision=N`): a frontend of its own
    for one pool or one revision, as a rollout's `checks` use."""
    decision_log: str | None = setting(None, flag="--router-decision-log")
    """Write one JSON line per routing decision to this file (any mode): the request, its model
    and pool, every candidate worker with its cached-block overlap and cost terms, the chosen
    worker, queue wait and migrations (docs/observability.md). Written off the hot path."""
    decision_log_max_mb: float = setting(100.0, flag="--router-decision-log-max-mb", gt=0)
    """Rotate the decision log past this size in MiB."""
    decision_log_keep: int = setting(3, flag="--router-decision-log-keep", ge=0)
    """Rotated decision logs kept (`PATH.1` newest); 0: the log starts over when full."""
    # The approximate indexer's (without KV events), as Dynamo's defaults; not user settings.
    ttl_s: float = 120.0
    max_tree_size: int = 2**20
    prune_target_ratio: float = 0.8

    def check(self, given: set[str], spell: Spell) -> None:
        """The rules that span settings; `given` names the settings the user gave."""
        if self.instance_labels is not None:
            try:
                parse_labels(self.instance_labels, spell("instance_labels"))
            except ValueError as err:
                raise SettingError(str(err)) from None
        sizing = [spell(name) for name in ("decision_log_max_mb", "decision_log_keep") if name in given]
        if sizing and self.decision_log is None:
            raise SettingError(
                f"{', '.join(sizing)}: size the decision log, which needs {spell('decision_log')}"
            )
        kv_only = [spell(name) for name in KV_ONLY if name in given]
        if kv_only and self.mode != "kv":
            raise SettingError(
                f"{', '.join(kv_only)}: session affinity and the router queue are the kv router's, "
                f"not {spell('mode')} {self.mode}'s: use {spell('mode')} kv"
            )
        if self.queue_reserve and (self.queue_threshold is None or self.queue_policy != "priority"):
            raise SettingError(
                f"{spell('queue_reserve')} keeps workers free for urgent requests: it needs the queue "
                f"({spell('queue_threshold')}) in priority order ({spell('queue_policy')} priority)"
            )


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Disaggregated prefill/decode at the frontend, for models with prefill workers."""

    conditional: bool = setting(False, flag="--router-conditional-disagg")
    """Prefill a prompt on the decode worker when fewer of its tokens than
    `max_local_prefill_length` are uncached there."""
    max_local_prefill_length: int = setting(512, flag="--max-local-prefill-length", ge=0)
    """The threshold of `conditional`, in uncached prompt tokens."""
    enforce: bool = setting(False, flag="--enforce-disagg")
    """Never prefill on a decode worker: without a prefill worker requests get 503."""
