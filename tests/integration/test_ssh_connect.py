"""ssh connections to a host that names no user: the ssh client's default user is taken (as
ssh(1) does), so an unreachable host is a problem in words, not a crash inside asyncssh."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_graph.graph.plan import RemoteHost
from dynamo_graph.graph.targets.local.remote.ssh import SshError, connect
from tests.support.processes import free_port


def test_a_host_without_a_user_that_refuses_is_an_ssh_error() -> None:
    host = RemoteHost(address="127.0.0.1", port=free_port())  # nothing listens there
    with pytest.raises(SshError, match="host 'h'"):
        asyncio.run(connect("h", host))
