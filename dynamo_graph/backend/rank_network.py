"""The network interface a rank of a multi-node replica talks to its peers on.

torch.distributed's gloo (vLLM's and SGLang's CPU groups, Python engines over torch) binds the
address its host name resolves to unless `GLOO_SOCKET_IFNAME` names an interface. Where the
host name resolves to loopback (containers, network namespaces, many Slurm nodes), each rank
then advertises 127.0.0.1 and its peers on other nodes cannot reach it. A worker on another host
is given the address the others reach it at (`DYN_TCP_HOST`: the ssh host's, the Slurm node's
`NodeAddr`), and only the node itself knows which of its interfaces holds it: so the rank looks
it up as it starts, before its engine spawns anything.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

from dynamo_graph.runtime.events import BIND_HOST_ENV

log = logging.getLogger(__name__)

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def interface_holding(address: str) -> str | None:
    """The interface whose IPv4 address is `address` on this machine, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def bind_gloo_to_host_address() -> None:
    """Set GLOO_SOCKET_IFNAME to the interface of this rank's host address, unless it is set
    or there is no such address (a graph on one host: loopback is right)."""
    address = os.environ.get(BIND_HOST_ENV)
    if IFNAME_ENV in os.environ or not address or address.startswith("127."):
        return
    name = interface_holding(address)
    if name is None:
        log.warning(
            "no interface holds %s=%s as its IPv4 address: set %s for gloo",
            BIND_HOST_ENV,
            address,
            IFNAME_ENV,
        )
        return
    os.environ[IFNAME_ENV] = name
    log.info("%s=%s (the interface of %s)", IFNAME_ENV, name, address)
