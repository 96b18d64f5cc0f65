"""The HTTP server's transport wrapper: what one loop turn writes goes out in one write, in order,
at the next turn; close writes what is left first; a closing transport takes nothing more."""

from __future__ import annotations

import asyncio

from dynamo_graph.frontend.coalesce import CoalescingTransport


class RecordingTransport(asyncio.Transport):
    """An asyncio transport that keeps its writes (a real socket's would be system calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        assert not self.closing, "written after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 5)}.get(name, default)


async def test_one_turn_is_one_write_at_the_next_turn() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    for event in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
        transport.write(event)
    assert inner.writes == []  # nothing until the turn ends
    await asyncio.sleep(0)
    assert inner.writes == [b"data: 1\n\ndata: 2\n\ndata: 3\n\n"]
    transport.write(b"data: 4\n\n")
    await asyncio.sleep(0)
    assert inner.writes[1:] == [b"data: 4\n\n"]  # a later turn: its own write, nothing waits


async def test_close_writes_what_is_gathered_first() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"tail")
    transport.close()
    assert inner.writes == [b"tail"]
    assert inner.closing
    await asyncio.sleep(0)  # the flush scheduled by the write finds nothing left
    assert inner.writes == [b"tail"]


async def test_a_closing_transport_takes_nothing_and_the_rest_is_the_transports() -> None:
    inner = RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())
    transport.write(b"late")
    inner.close()  # the peer went away within the turn
    await asyncio.sleep(0)
    assert inner.writes == []
    assert transport.is_closing()
    assert transport.get_extra_info("peername") == ("127.0.0.1", 5)
