""" "Remote hosts" for tests: network namespaces joined to this one by veth pairs, each running
a real OpenSSH server with generated host and user keys (docs/testing.md).

The namespaces share the filesystem and the pid space with the test, so a remote host's venv
is the project's own, and a remote process is visible here by its pid. Subnets come from the
test process's pid (10.250-254.x.0/24) so parallel runs do not collide. `stop()` ends the
processes inside the namespaces (all started by the test: sshd and what ran under it) by pid,
then deletes the veths and namespaces, whatever state the test left them in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def missing_requirements() -> str | None:
    """Why these hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    for tool in ("ip", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not Path(SSHD).exists():
        return "openssh-server not installed (apt-get install -y openssh-server)"
    return None


def _sh(*args: str, ns: str | None = None) -> str:
    argv = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


@dataclass
class SshHost:
    key: str  # the host's key in a graph
    ns: str
    address: str  # the namespace's address, where sshd listens
    gateway: str  # this namespace's end of the veth: where the remote host reaches us
    veth: str
    dir: Path

    @property
    def host_key_pub(self) -> str:
        return " ".join((self.dir / "host_key.pub").read_text().split()[:2])

    def sshd_pid(self) -> int:
        return int((self.dir / "sshd.pid").read_text())

    def pids(self) -> list[int]:
        """Every process inside the namespace (`ip netns pids`)."""
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, timeout=10)
        return [int(p) for p in out.stdout.split()]

    def session_pids(self) -> list[int]:
        """sshd's children: one per connection (kill one to cut that connection)."""
        listener = self.sshd_pid()
        return [p for p in self.pids() if _ppid(p) == listener]

    def listening_ports(self) -> list[int]:
        out = _sh("ss", "-Hltn", ns=self.ns)
        ports = [int(line.split()[3].rpartition(":")[2]) for line in out.splitlines() if line.strip()]
        return [p for p in ports if p != 22]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


class SshHosts:
    """`count` hosts `h0`, `h1`, ... with one user key and a known_hosts file listing them all."""

    def __init__(self, tmp: Path, count: int = 2) -> None:
        self.dir = tmp
        self.hosts: list[SshHost] = []
        self.user_key = tmp / "user_key"
        self.known_hosts = tmp / "known_hosts"
        pid = os.getpid()
        self._second, self._third = 250 + pid % 5, (pid // 5) % 60 * 4
        self._tag = f"{pid % 100000}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.user_key)], check=True)
        (tmp / "authorized_keys").write_text((tmp / "user_key.pub").read_text())
        (tmp / "authorized_keys").chmod(0o600)
        Path("/run/sshd").mkdir(exist_ok=True)
        try:
            for i in range(count):
                self._add(i)
        except BaseException:
            self.stop()
            raise
        self.known_hosts.write_text("".join(f"{h.address} {h.host_key_pub}\n" for h in self.hosts))

    def _add(self, i: int) -> None:
        net = f"10.{self._second}.{self._third + i}"
        host = SshHost(
            key=f"h{i}",
            ns=f"dgs{self._tag}h{i}",
            address=f"{net}.2",
            gateway=f"{net}.1",
            veth=f"vs{self._tag}h{i}",
            dir=self.dir / f"h{i}",
        )
        host.dir.mkdir()
        self.hosts.append(host)  # from here on, stop() cleans it up
        peer = f"vs{self._tag}n{i}"
        _sh("ip", "netns", "add", host.ns)
        _sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _sh("ip", "link", "set", peer, "netns", host.ns)
        _sh("ip", "addr", "add", f"{host.gateway}/24", "dev", host.veth)
        _sh("ip", "link", "set", host.veth, "up")
        _sh("ip", "addr", "add", f"{host.address}/24", "dev", peer, ns=host.ns)
        _sh("ip", "link", "set", peer, "up", ns=host.ns)
        _sh("ip", "link", "set", "lo", "up", ns=host.ns)
        _sh("ip", "route", "add", "default", "via", host.gateway, ns=host.ns)  # reach the other veths' hosts
        key = host.dir / "host_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        config = host.dir / "sshd_config"
        config.write_text(
            f"ListenAddress {host.address}\nPort 22\nHostKey {key}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            f"PasswordAuthentication no\nUsePAM no\nStrictModes no\nPidFile {host.dir / 'sshd.pid'}\n"
            "MaxStartups 64\n"  # MaxSessions stays OpenSSH's default (10 per connection)
            # DYNGRAPH_SSH_PYTHONPATH=<worktree>: the hosts' sessions (agents, workers) run a worktree's
            # code rather than the venv's install (then every python there finds dyngraph, which the
            # preflight test's "python without dyngraph" host cannot tell apart).
            + (f"SetEnv PYTHONPATH={path}\n" if (path := os.environ.get("DYNGRAPH_SSH_PYTHONPATH")) else "")
        )
        _sh(SSHD, "-f", str(config), "-E", str(host.dir / "sshd.log"), ns=host.ns)
        deadline = time.monotonic() + 10
        while not (host.dir / "sshd.pid").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"sshd in {host.ns} did not start: {(host.dir / 'sshd.log').read_text()}")
            time.sleep(0.02)

    def stop(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                for pid in host.pids():  # sshd and whatever ran under it: all started by this test
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True, timeout=10)
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=10)
        self.hosts = []

    def graph_hosts(self, venv: Path, **extra: object) -> dict[str, dict[str, object]]:
        """The `hosts:` block of a graph for these hosts, plus `local` advertised on the first veth."""
        hosts: dict[str, dict[str, object]] = {
            h.key: {
                "ssh": {
                    "address": h.address,
                    "user": "root",
                    "identity_file": str(self.user_key),
                    "known_hosts": str(self.known_hosts),
                },
                "venv": str(venv),
                **extra,
            }
            for h in self.hosts
        }
        hosts["local"] = {"advertise_host": self.hosts[0].gateway}
        return hosts
