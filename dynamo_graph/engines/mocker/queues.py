"""The mocker's waiting queue under vLLM's two scheduling policies (`scheduling_policy`).

vLLM (v1, `vllm/v1/core/sched/request_queue.py`) keeps its waiting requests in one of:

- `fcfs`: a deque in arrival order; a preempted request goes back to the head.
- `priority`: a heap ordered by (priority, arrival time, request id), lower priority first;
  a preempted request is pushed back into the heap ("there is no concept of prepending").

`FcfsQueue` and `PriorityQueue` are the same two orders over the mocker's sequences. Priority
here has Dynamo's sign (higher is more urgent: `x-dynamo-request-priority`), so the heap key is
(-priority, arrival); `arrival` is the rank's admission counter, unique, so it also plays vLLM's
request-id tie-break. With every priority equal the two orders are the same: the scheduler
admits strictly from the head, so every waiting sequence arrived after every running one, and a
preempted sequence (the latest-arrived running one) is the earliest of the waiting ones.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    priority: int
    arrival: int


T = TypeVar("T", bound=Queued)


class FcfsQueue(Generic[T]):
    """Arrival order; a preempted sequence is prepended."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def add(self, item: T) -> None:
        self._items.append(item)

    def prepend(self, item: T) -> None:
        self._items.appendleft(item)

    def peek(self) -> T:
        return self._items[0]

    def pop(self) -> T:
        return self._items.popleft()

    def remove_if(self, gone: Callable[[T], bool]) -> list[T]:
        """Take out the items `gone` selects; returns them."""
        kept, removed = _split(self._items, gone)
        self._items = deque(kept)
        return removed

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)


class PriorityQueue(Generic[T]):
    """Most urgent first, then earliest arrival; a preempted sequence is re-inserted by that key."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, T]] = []

    def add(self, item: T) -> None:
        heapq.heappush(self._heap, (-item.priority, item.arrival, item))

    prepend = add

    def peek(self) -> T:
        return self._heap[0][2]

    def pop(self) -> T:
        return heapq.heappop(self._heap)[2]

    def remove_if(self, gone: Callable[[T], bool]) -> list[T]:
        kept, removed = _split(self._heap, lambda entry: gone(entry[2]))
        if removed:
            heapq.heapify(kept)
            self._heap = kept
        return [entry[2] for entry in removed]

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        """In the order they would be admitted."""
        return (entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1])))


E = TypeVar("E")


def _split(items: Iterable[E], gone: Callable[[E], bool]) -> tuple[list[E], list[E]]:
    """(kept, removed), each in the order given; `gone` is asked once per item."""
    kept: list[E] = []
    removed: list[E] = []
    for item in items:
        (removed if gone(item) else kept).append(item)
    return kept, removed


def waiting_queue(policy: str) -> FcfsQueue | PriorityQueue:
    """The waiting queue of a `scheduling_policy` ("fcfs" or "priority")."""
    return PriorityQueue() if policy == "priority" else FcfsQueue()
