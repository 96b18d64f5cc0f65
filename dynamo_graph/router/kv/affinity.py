"""Session affinity: the turns of one conversation or agent go to the worker that holds its prefix.

As Dynamo 1.5 spells it: `--router-session-affinity-ttl-secs` (0: off) binds a session id (the
`x-session-id` header, or `nvext.agent_context.session_id`) to the worker rank its last request
went to, for that many seconds after its last use. `--router-session-affinity-mode`:

- `hard`: a bound session always goes to its rank while that rank is a candidate (a worker that
  left, or is excluded after failing the request, frees the binding).
- `soft` (default): it goes there unless that rank's cost is clearly worse than the best rank's
  (`SOFT_YIELD_RATIO` times the best predicted TTFT, or Dynamo's cost), e.g. a long prefill queue
  built up behind it; the session is then bound to where it went.

Without KV events the prefix is then still warm where the router expects it, and with them the
binding saves the race between a turn's KV events and the next turn.
Expiry is lazy: bindings are kept in last-use order (an OrderedDict), so expiring pops from the
front; `max_sessions` bounds the table (the least recently used go first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

from dynamo_graph.router.kv.cost import Choice
from dynamo_graph.router.kv.sequences import WorkerKey

AffinityMode = Literal["hard", "soft"]
AFFINITY_MODES: tuple[AffinityMode, ...] = ("hard", "soft")
SOFT_YIELD_RATIO = 1.5
DEFAULT_MAX_SESSIONS = 1 << 20


class SessionAffinity:
    def __init__(
        self,
        ttl_s: float,
        mode: AffinityMode = "soft",
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session affinity ttl must be positive, not {ttl_s}")
        if mode not in AFFINITY_MODES:
            raise ValueError(f"session affinity mode must be hard or soft, not {mode!r}")
        self.ttl_s = ttl_s
        self.mode = mode
        self.max_sessions = max_sessions
        self._clock = clock
        self._bound: OrderedDict[str, tuple[WorkerKey, float]] = OrderedDict()
        self.kept = 0  # requests that went to their session's rank
        self.yielded = 0  # soft bindings that gave way to a clearly better rank

    def __len__(self) -> int:
        return len(self._bound)

    def _expire(self, now: float) -> None:
        bound = self._bound
        while bound:
            session = next(iter(bound))
            if bound[session][1] > now:
                return
            del bound[session]

    def bound(self, session: str) -> WorkerKey | None:
        self._expire(self._clock())
        entry = self._bound.get(session)
        return entry[0] if entry is not None else None

    def bind(self, session: str, key: WorkerKey) -> None:
        now = self._clock()
        bound = self._bound
        bound.pop(session, None)
        bound[session] = (key, now + self.ttl_s)
        while len(bound) > self.max_sessions:
            bound.popitem(last=False)

    def pick(self, session: str, choices: Sequence[Choice]) -> Choice | None:
        """The session's rank among `choices` if the binding holds, else None (route as usual)."""
        key = self.bound(session)
        if key is None:
            return None
        mine = next((c for c in choices if c.key == key), None)
        if mine is None:
            return None
        if self.mode == "soft":
            best = min(c.logit for c in choices)
            if mine.logit > SOFT_YIELD_RATIO * best:
                self.yielded += 1
                return None
        self.kept += 1
        return mine

    def remove_worker(self, worker_id: int) -> None:
        for session in [s for s, (key, _) in self._bound.items() if key[0] == worker_id]:
            del self._bound[session]
