"""Holding requests at the frontend while every worker is saturated, in priority order.

With `--router-queue-threshold F` (as in Dynamo: a fraction, >= 0), a worker rank is busy while
its prefill tokens exceed F times its `max_num_batched_tokens` (from its model card; a worker
that does not say counts as 10,000,000, i.e. is never busy). Its prefill tokens are the prompt
tokens routed to it and still waiting for their first token (the router's own bookkeeping) or,
when larger, those it last reported accepted and not yet computed (its load metrics, so work
another frontend sent counts). While some rank is not busy, a request is routed at once; when
every rank is, it waits here instead of piling onto a worker queue where nothing can reorder it.
F = 0 queues as soon as every rank has any prefill work; F = 1, once every rank has a full batch
of prompt tokens waiting. Whenever a rank's backlog shrinks (a first token, a request's end, a
load report; and at least every `RECHECK_S` while requests wait, for reports that went stale)
the head of the queue is routed.

Order (`--router-queue-policy`): `priority` (default) serves the highest priority first
(`x-dynamo-request-priority` / `nvext.agent_hints.priority` / `nvext.priority`; higher is more
urgent, as in Dynamo; 0 by default), first come first served among equals; `fcfs` ignores
priorities; `wspt` (Dynamo's weighted shortest processing time, Smith's rule) serves the highest
(1 + priority) / uncached prompt tokens first, the uncached tokens counted on the best-placed
worker when the request arrives: short and cached requests go before long ones (on one server
the order with the least mean wait for a backlog, at the long requests' expense; negative
priorities count as 0, as in Dynamo). A new request never overtakes a waiting one that it does
not outrank: it joins the queue whenever the queue is not empty.

Reserve (`--router-queue-reserve R`, priority order only): while urgent requests (priority > 0)
are arriving (one within the last `RESERVE_WINDOW_S`), ordinary ones are routed only while more
than R ranks are not busy; urgent ones go whenever one is. At threshold 0 that keeps R ranks free
of ordinary prefill work, so an urgent request starts its prefill at once instead of waiting for
a pass in flight (passes cannot be preempted): its time to first token stays near the unloaded
one, at the price of the reserved ranks' prefill throughput for ordinary work under overload
(they still decode). Without urgent traffic nothing is held back. Off (0) by default.

Past `max_size` waiting requests a new one is refused at once with `QueueFull` (the frontend
answers 529, or 503 with DYN_HTTP_OVERLOAD_STATUS_CODE=503, with Retry-After), before any output:
nothing is lost silently. When the newcomer outranks the lowest-ranked waiting request, that one
(the most recent among equals) is refused instead. A waiting request whose client goes away (or
whose deadline passes) leaves the queue.

Only one dispatched request is "in transit" (woken but not yet booked on a worker) at a time,
so the saturation test always sees the load the previous dispatch added.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Literal

from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import Overloaded

QueuePolicy = Literal["priority", "fcfs", "wspt"]
QUEUE_POLICIES: tuple[QueuePolicy, ...] = ("priority", "fcfs", "wspt")
DEFAULT_MAX_QUEUE = 1024
RETRY_AFTER_S = 1
RECHECK_S = 0.25
RESERVE_WINDOW_S = 10.0  # the reserve holds while an urgent request came within this long
# A worker's max_num_batched_tokens when its card does not say (Dynamo's: never busy).
DEFAULT_MAX_BATCHED_TOKENS = 10_000_000
_FULL = "every worker is saturated and the router's queue is full; retry shortly"


class QueueFull(Overloaded):
    """Every worker is saturated and the frontend's queue is full: retry after `retry_after_s`."""

    http_status = 529
    retry_after_s = RETRY_AFTER_S


class RouterQueue:
    def __init__(
        self,
        free_ranks: Callable[[], float],
        *,
        policy: QueuePolicy = "priority",
        max_size: int = DEFAULT_MAX_QUEUE,
        reserve: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`free_ranks`: how many worker ranks are below the threshold now."""
        if policy not in QUEUE_POLICIES:
            choices = ", ".join(QUEUE_POLICIES)
            raise ValueError(f"router queue policy must be one of {choices}, not {policy!r}")
        if max_size < 0:
            raise ValueError(f"router queue size must be >= 0, not {max_size}")
        if reserve < 0:
            raise ValueError(f"router queue reserve must be >= 0, not {reserve}")
        self._free_ranks = free_ranks
        self.reserve = reserve
        self._clock = clock
        self._last_urgent = -float("inf")
        self.policy = policy
        self.max_size = max_size
        # (rank, arrival order, urgent, waiter)
        self._heap: list[tuple[float, int, bool, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._in_transit = 0
        self._recheck: asyncio.TimerHandle | None = None
        self.queued_total = 0
        self.rejected = 0

    def __len__(self) -> int:
        return sum(1 for *_, waiter in self._heap if not waiter.done())

    def _saturated(self, urgent: bool) -> bool:
        """Whether a request (`urgent` or not) must wait: no rank is free, or, for an ordinary
        one while urgent requests are arriving, no more than the reserve."""
        held = 0
        if not urgent and self.reserve and self._clock() - self._last_urgent < RESERVE_WINDOW_S:
            held = self.reserve
        return self._free_ranks() <= held

    def _rank(self, priority: int, uncached_tokens: Callable[[], int] | None) -> float:
        """The request's place in the queue: lower goes first (ties: first come)."""
        if self.policy == "priority":
            return -priority
        if self.policy == "wspt":
            tokens = uncached_tokens() if uncached_tokens is not None else 1
            return -(1 + max(priority, 0)) / max(tokens, 1)
        return 0

    async def admit(
        self, priority: int, context: Context, uncached_tokens: Callable[[], int] | None = None
    ) -> bool:
        """Return when the request may be routed (True), or False if its client stopped it while
        it waited. `uncached_tokens`: the prompt tokens the request would compute on the
        best-placed worker (asked only when `wspt` queues it). The caller must call `routed()`
        once it has booked the request on a worker (or given up), so that the next waiting
        request can go."""
        urgent = self.policy == "priority" and priority > 0
        if urgent:
            self._last_urgent = self._clock()
        if not self._heap and not self._in_transit and not self._saturated(urgent):
            self._in_transit += 1
            return True
        rank = self._rank(priority, uncached_tokens)
        if len(self) >= self.max_size:
            self._make_room(rank)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (rank, next(self._order), urgent, waiter))
        self.queued_total += 1
        self.pump()
        stop = asyncio.ensure_future(context.stopped())
        try:
            await asyncio.wait((waiter, stop), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (e.g. the request's deadline) while waiting
            self._leave(waiter)
            raise
        finally:
            stop.cancel()
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            raise waiter.exception()  # type: ignore[misc]  # pushed out by a more urgent request
        if waiter.done() and not context.is_stopped():
            return True
        self._leave(waiter)
        return False

    def _make_room(self, rank: float) -> None:
        """The queue is full: the least urgent, most recent waiter is refused in favour of a
        more urgent newcomer; else the newcomer is."""
        waiting = [entry for entry in self._heap if not entry[3].done()]
        last = max(waiting, key=lambda entry: (entry[0], entry[1]), default=None)
        self.rejected += 1
        if last is None or last[0] <= rank:
            raise QueueFull(_FULL)
        last[3].set_exception(QueueFull(_FULL))

    def _leave(self, waiter: asyncio.Future[None]) -> None:
        """A waiting request gives up: out of the queue, or if it was already dispatched, let
        the next one go in its place."""
        if not waiter.done():
            waiter.cancel()  # pump skips it
        elif not waiter.cancelled() and waiter.exception() is None:
            self.routed()

    def routed(self) -> None:
        """A dispatched request is booked on a worker (or gave up): the next one may go."""
        if self._in_transit:
            self._in_transit -= 1
        self.pump()

    def pump(self) -> None:
        """Dispatch the head of the queue if nothing is in transit and a rank has room."""
        heap = self._heap
        while heap and heap[0][3].done():
            heapq.heappop(heap)
        if not heap or self._in_transit:
            return
        if self._saturated(heap[0][2]):
            # A rank can also free up without an event here (its load report goes stale).
            if self._recheck is None:
                self._recheck = asyncio.get_running_loop().call_later(RECHECK_S, self._rechecked)
            return
        waiter = heapq.heappop(heap)[3]
        self._in_transit += 1
        waiter.set_result(None)

    def _rechecked(self) -> None:
        self._recheck = None
        self.pump()
