"""Whether a worker's hub model id (`org/name`) can be had on this host, asked by preflight.

A worker resolves a hub id from the host's Hugging Face cache, or downloads it at start
(llm/model_source.py). Where neither can work — not cached and the hub unreachable, offline
mode, or no such repo — the worker would crash-loop at start; preflight says so first. The
answer uses the worker's own HF_* environment (its cache, endpoint, token, offline flag) over
the host's, as the worker will.

A repo counts as cached when its cache folder (huggingface_hub's layout,
`<cache>/models--org--name/snapshots/<revision>/`) holds a snapshot with files; otherwise the
hub's model API is asked (a few seconds at most): reachable and found means the worker will
download it, which preflight lets through.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HF_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_TOKEN")
DEFAULT_ENDPOINT = "https://huggingface.co"
ASK_TIMEOUT_S = 5.0
_TRUE = ("1", "true", "yes", "on")


def hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps repos for a process with this environment."""
    if cache := env.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := env.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg) / "huggingface" / "hub"


def is_cached(repo_id: str, cache: Path) -> bool:
    snapshots = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    try:
        return any(any(rev.iterdir()) for rev in snapshots.iterdir() if rev.is_dir())
    except OSError:  # no such folder
        return False


def hub_problem(repo_id: str, worker_env: Mapping[str, str]) -> str | None:
    """Why a worker with `worker_env` (its HF_* variables; the host's fill the rest) could not
    get `repo_id`, or None."""
    env = {**os.environ, **worker_env}
    cache = hub_cache(env)
    if is_cached(repo_id, cache):
        return None
    fix = (
        f"download it where the hub is reachable (`hf download {repo_id}`) and copy the cache to "
        f"{cache}, set HF_HOME to a cache that holds it, or give a local model folder"
    )
    if env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return f"is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: {fix}"
    import httpx  # only for hub ids

    endpoint = (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token = env.get("HF_TOKEN", "").strip()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(
            f"{endpoint}/api/models/{repo_id}", headers=headers, timeout=ASK_TIMEOUT_S, follow_redirects=True
        )
    except httpx.HTTPError as e:
        why = str(e) or type(e).__name__
        return f"is not in the Hugging Face cache ({cache}) and {endpoint} cannot be reached ({why}): {fix}"
    if answer.status_code in (401, 404):  # the hub answers 401 for a missing repo without a token
        needs = "" if token else " (or it is private or gated: set HF_TOKEN for the worker)"
        return f"is not in the Hugging Face cache ({cache}) and {endpoint} has no such model{needs}"
    return None  # found (downloaded at start), or an answer preflight cannot judge (rate limits, 5xx)
