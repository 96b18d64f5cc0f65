"""What a graph's processes listen on, and what a peer without the graph's certificate gets there:
the checks of `security.tls` (tests/system/test_tls.py, test_remote_hosts.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from pathlib import Path

from dynamo_graph.runtime.transport.frames import HEADER, Request, encode

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _descendants(pids: list[int]) -> set[int]:
    """`pids` and every process below them."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(pids), list(pids)
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in found]
        found.update(children)
        frontier.extend(children)
    return found


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of each TCP socket that `pids` (or their children) listen on, as seen
    from each process's own network namespace."""
    out: list[tuple[int, str, int]] = []
    for pid in sorted(_descendants(pids)):
        try:
            inodes = {
                os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
                for fd in os.listdir(f"/proc/{pid}/fd")
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
            }
        except OSError:
            continue
        for table, v6 in (("tcp", False), ("tcp6", True)):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == _LISTEN and fields[9] in inodes:
                        address, port = fields[1].split(":")
                        out.append((pid, _address(address, v6), int(port, 16)))
    return out


def _address(hex_address: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_address)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    text = socket.inet_ntop(socket.AF_INET6, words)
    return text.removeprefix("::ffff:") if text.startswith("::ffff:") and "." in text else text


def plain_answer(host: str, port: int) -> bytes:
    """What a port answers, in plain TCP, a request frame of the tcp plane followed by a NATS
    CONNECT/PING: b"" when it closes, else what it sent."""
    payload = encode(Request(1, "ns.comp.generate-1", {}, b"plain prompt", "r-1"))
    got = b""
    with socket.create_connection((host, port), timeout=3) as sock, contextlib.suppress(OSError):
        sock.sendall(HEADER.pack(len(payload)) + payload + b'CONNECT {"verbose":false}\r\nPING\r\n')
        while chunk := sock.recv(4096):
            got += chunk
    return got


def tls_refuses(host: str, port: int, shown: tuple[str, str]) -> bool:
    """Whether a port ends the TLS session of a client showing the certificate `shown` (its
    files) at once (an alert, or the connection closed), rather than waiting for its request as
    it does for a peer it accepts (TLS 1.3: the server judges the client's certificate after the
    client's side of the handshake is done, so the verdict is the first read)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(*shown)
    try:
        with socket.create_connection((host, port), timeout=3) as raw, ctx.wrap_socket(raw) as sock:
            sock.settimeout(1.0)
            try:
                return sock.recv(4096) == b""
            except TimeoutError:
                return False  # waiting for a request: accepted
    except (OSError, ssl.SSLError):  # an alert, at the handshake or at the first read
        return True


def tls_without_certificate(host: str, port: int) -> str | bytes:
    """A TLS client without a certificate: the error that ended it, or what the port sent it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=3) as raw, ctx.wrap_socket(raw) as sock:
            sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            return sock.recv(4096)
    except (OSError, ssl.SSLError) as err:
        return f"{type(err).__name__}: {err}"
