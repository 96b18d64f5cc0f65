"""Event plane over core NATS (many machines): one subject per topic, fire-and-forget.

Subjects are `dyn.events.{namespace}.{component}.{topic}` with each part reduced to one subject
token (characters other than letters, digits, '_' and '-' become '_'), so any topic is a valid
subject; the exact topic rides in a header when it differs. The publisher id and a sequence number
per publisher and topic ride in headers so that subscribers can count what they missed.

A subscriber subscribes to the whole channel (`dyn.events.{ns}.{comp}.>`) and filters by topic
prefix itself: NATS matches whole tokens only, and the other planes match string prefixes. Its
subscription is bounded (`pending_msgs_limit`); when it falls behind, nats-py drops the newest
messages (a "slow consumer") and the publisher is never held up.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dynamo_graph.redact import redact_url
from dynamo_graph.runtime.credentials import nats_connect_options
from dynamo_graph.runtime.events.base import Event, EventPublisher, EventSubscriber
from dynamo_graph.runtime.events.common import DEFAULT_MAX_PENDING, GapCounter, check_topics

log = logging.getLogger(__name__)

SUBJECT_ROOT = "dyn.events"
HEADER_PUBLISHER = "Dyn-Publisher"
HEADER_SEQ = "Dyn-Seq"
HEADER_TOPIC = "Dyn-Topic"
MAX_PENDING_BYTES = 64 * 1024 * 1024  # per subscription, on top of the message-count bound
CONNECT_TIMEOUT_S = 5.0
ErrorCallback = Callable[[Exception], Awaitable[None]]
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_\-]")


def subject_token(text: str) -> str:
    """One NATS subject token: no '.', wildcards or whitespace, never empty."""
    return _NOT_TOKEN.sub("_", text) or "_"


def channel_subject(namespace: str, component: str) -> str:
    return f"{SUBJECT_ROOT}.{subject_token(namespace)}.{subject_token(component)}"


async def _log_error(exc: Exception) -> None:
    log.warning("event plane NATS connection: %s", exc)


async def _connect(
    nats_url: str, name: str, error_cb: ErrorCallback = _log_error, env: Mapping[str, str] | None = None
) -> Client:
    """Reconnect forever once connected (meanwhile nats-py buffers up to 2 MB of publishes; the
    rest are dropped, as the plane allows), but give up on the first connect after
    CONNECT_TIMEOUT_S, naming the URL. Credentials from `env` (default: this process's)."""
    nc = Client()
    try:
        await asyncio.wait_for(
            nc.connect(
                nats_url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=error_cb,
                **nats_connect_options(env),
            ),
            CONNECT_TIMEOUT_S,
        )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        await nc.close()
        raise ConnectionError(
            f"event plane: cannot connect to NATS at {redact_url(nats_url)}: {exc!r}"
        ) from exc
    return nc


class NatsEventPublisher(EventPublisher):
    def __init__(self, nc: Client, channel: str, publisher_id: int) -> None:
        self.publisher_id = publisher_id
        self.dropped = 0
        """Events not sent because the connection was down and its outbound buffer full."""
        self._nc = nc
        self._channel = channel
        self._publisher_hex = f"{publisher_id:x}"
        self._seqs: dict[str, int] = {}

    @classmethod
    async def create(
        cls, nats_url: str, namespace: str, component: str, publisher_id: int
    ) -> NatsEventPublisher:
        nc = await _connect(nats_url, f"dyn-events-pub-{namespace}.{component}.{publisher_id:x}")
        return cls(nc, channel_subject(namespace, component), publisher_id)

    async def publish(self, topic: str, payload: bytes) -> None:
        seq = self._seqs[topic] = self._seqs.get(topic, 0) + 1
        token = subject_token(topic)
        headers = {HEADER_PUBLISHER: self._publisher_hex, HEADER_SEQ: str(seq)}
        if token != topic:
            headers[HEADER_TOPIC] = topic
        try:
            await self._nc.publish(f"{self._channel}.{token}", payload, headers=headers)
        except nats.errors.OutboundBufferLimitError:
            self.dropped += 1

    async def close(self) -> None:
        if not self._nc.is_closed:
            await self._nc.flush()
            await self._nc.close()


class NatsEventSubscriber(EventSubscriber):
    def __init__(self, topics: tuple[str, ...], channel: str) -> None:
        self.topics = topics
        self.slow_consumer_drops = 0
        """Messages nats-py discarded because this subscription's buffer was full."""
        self._gaps = GapCounter()
        self._channel_prefix_len = len(channel) + 1
        self._nc: Client | None = None
        self._sub: Subscription | None = None

    @property
    def dropped(self) -> int:
        """Events known lost, from sequence gaps (a loss shows once that topic's publisher sends
        again). Includes `slow_consumer_drops` once they show."""
        return self._gaps.missed

    @classmethod
    async def create(
        cls,
        nats_url: str,
        namespace: str,
        component: str,
        topics: Sequence[str],
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        env: Mapping[str, str] | None = None,
    ) -> NatsEventSubscriber:
        """Subscribed once this returns; credentials from `env` (default: this process's)."""
        channel = channel_subject(namespace, component)
        self = cls(check_topics(topics), channel)
        name = f"dyn-events-sub-{namespace}.{component}"
        self._nc = await _connect(nats_url, name, error_cb=self._error, env=env)
        self._sub = await self._nc.subscribe(
            f"{channel}.>", pending_msgs_limit=max_pending, pending_bytes_limit=MAX_PENDING_BYTES
        )
        await self._nc.flush()  # the server has the subscription once this returns
        return self

    async def _error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            if self.slow_consumer_drops == 0:
                log.warning("event subscriber on %s is too slow: dropping events", exc.subject)
            self.slow_consumer_drops += 1
        else:
            await _log_error(exc)

    def _event(self, msg: Msg) -> Event | None:
        headers = msg.headers or {}
        topic = headers.get(HEADER_TOPIC) or msg.subject[self._channel_prefix_len :]
        if not topic.startswith(self.topics):
            return None
        try:
            publisher_id = int(headers[HEADER_PUBLISHER], 16)
            self._gaps.see(publisher_id, topic, int(headers[HEADER_SEQ]))
        except (KeyError, ValueError):
            log.warning("dropping an event without valid publisher/seq headers on %s", msg.subject)
            return None
        return Event(topic, msg.data, publisher_id)

    async def events(self) -> AsyncIterator[Event]:
        if self._sub is None:
            return
        async for msg in self._sub.messages:
            event = self._event(msg)
            if event is not None:
                yield event

    async def close(self) -> None:
        sub, nc, self._sub, self._nc = self._sub, self._nc, None, None
        if sub is not None and nc is not None and not nc.is_closed:
            await sub.unsubscribe()
            await nc.close()
