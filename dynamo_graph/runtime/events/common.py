"""Pieces shared by the event-plane backends: topic-prefix checks and per-publisher gap counting."""

from __future__ import annotations

from collections.abc import Sequence

ALL_INTERFACES = frozenset({"", "*", "0.0.0.0", "::", "[::]"})  # bind addresses zmq refuses
DEFAULT_MAX_PENDING = 65_536
"""Events buffered per subscriber (and per publisher->subscriber pipe for zmq) before dropping."""


def check_topics(topics: Sequence[str]) -> tuple[str, ...]:
    """Topic prefixes as a tuple. At least one is needed ("" matches every topic), so that an empty
    list is reported as a mistake rather than being a silent subscription to nothing."""
    if isinstance(topics, str):
        raise TypeError("topics must be a sequence of topic prefixes, not one string")
    if not topics:
        raise ValueError("topics: give at least one topic prefix ('' matches every topic)")
    return tuple(topics)


class GapCounter:
    """Counts events lost on the way, from the sequence numbers (1, 2, ...) a publisher stamps on
    each topic. Numbering per topic (not per publisher) keeps counting exact when a subscriber
    sees only some topics. A loss shows once a later event on that topic arrives; a number that
    goes backwards means the publisher restarted under the same id and starts a new run."""

    def __init__(self) -> None:
        self.missed = 0
        self._last: dict[int, dict[str, int]] = {}

    def see(self, publisher_id: int, topic: str, seq: int) -> None:
        topics = self._last.setdefault(publisher_id, {})
        last = topics.get(topic)
        if last is not None and seq > last + 1:
            self.missed += seq - last - 1
        topics[topic] = seq

    def forget(self, publisher_id: int) -> None:
        """The publisher is gone: drop its state so that ids do not pile up."""
        self._last.pop(publisher_id, None)
