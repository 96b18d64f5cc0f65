"""A real Slurm cluster for tests, built from scratch in a temp dir (docs/testing.md):
its own munged (key, socket), slurm.conf, state dirs and ports, a slurmctld and one slurmd per
node. With two nodes the second slurmd runs in a network namespace joined by a veth pair, so a
step there sees only that node's address. Nothing outside the temp dir is touched: clients find
the cluster through SLURM_CONF (`env()`), never /etc/slurm.

Every daemon is started with SLURM_CONF in its environment, which slurmstepd and each task
inherit: `processes()` finds everything of this cluster by it, and `stop()` cancels the jobs,
stops the daemons by their pids, then SIGKILLs whatever of the cluster is still alive, and
deletes the namespace — whatever state the test left it in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")


def missing_requirements(nodes: int = 1) -> str | None:
    """Why this cluster cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs steps as any user; ip netns for a second node)"
    for path in DAEMONS:
        if not Path(path).exists():
            return f"{path} not installed (apt-get install -y slurm-wlm munge)"
    for tool in CLIENTS + (("ip", "nsenter") if nodes > 1 else ()):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _run(*argv: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30, env=env).stdout


class SlurmCluster:
    """Nodes `dg1` (this network namespace) and, with `nodes=2`, `dg2` (its own namespace)."""

    def __init__(self, tmp: Path, nodes: int = 1) -> None:
        self.dir = tmp
        self.conf = tmp / "slurm.conf"
        pid = os.getpid()
        net = f"10.{245 + pid % 5}.{(pid // 5) % 250}"
        self.ns = f"dgslurm{pid % 100000}" if nodes > 1 else None
        self.veth = f"vsl{pid % 100000}"
        self.addresses = {"dg1": "127.0.0.1"} if nodes == 1 else {"dg1": f"{net}.1", "dg2": f"{net}.2"}
        self._daemon_pids: list[int] = []
        try:
            self._start(nodes)
        except BaseException:
            self.stop()
            raise

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start(self, nodes: int) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = munge / "munge.sock"
        _run(
            DAEMONS[0], "--force", f"--key-file={key}", f"--socket={self.socket}",
            f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )  # fmt: skip
        self._daemon_pids.append(int((munge / "munged.pid").read_text()))
        if self.ns:
            self._netns()
        self._write_conf()
        env = self.env()
        _run(DAEMONS[1], "-f", str(self.conf), env=env)
        self._daemon_pids.append(self._pid("slurmctld.pid"))
        _run(DAEMONS[2], "-f", str(self.conf), "-N", "dg1", env=env)
        self._daemon_pids.append(self._pid("slurmd-dg1.pid"))
        if self.ns:
            # nsenter, not `ip netns exec`: that remounts /sys, and slurmd then finds no cgroup fs.
            netns = f"--net=/var/run/netns/{self.ns}"
            _run("nsenter", netns, DAEMONS[2], "-f", str(self.conf), "-N", "dg2", env=env)
            self._daemon_pids.append(self._pid("slurmd-dg2.pid"))
        self._wait_idle(list(self.addresses))

    def _netns(self) -> None:
        assert self.ns is not None
        peer = f"{self.veth}p"
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", self.ns)
        _run("ip", "addr", "add", f"{self.addresses['dg1']}/24", "dev", self.veth)
        _run("ip", "link", "set", self.veth, "up")
        for argv in (
            ("ip", "addr", "add", f"{self.addresses['dg2']}/24", "dev", peer),
            ("ip", "link", "set", peer, "up"),
            ("ip", "link", "set", "lo", "up"),
        ):
            _run("ip", "netns", "exec", self.ns, *argv)

    def _write_conf(self) -> None:
        host, d = socket.gethostname().split(".")[0], self.dir  # slurmctld matches the short name
        node_lines = [
            f"NodeName={name} NodeAddr={addr} NodeHostname={host if name == 'dg1' else name} "
            "CPUs=16 RealMemory=20000 State=UNKNOWN"
            for name, addr in self.addresses.items()
        ]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=dgtest",
                    f"SlurmctldHost={host}({self.addresses['dg1']})",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.socket}",
                    f"StateSaveLocation={d / 'state'}",
                    f"SlurmdSpoolDir={d / 'spool-%n'}",
                    f"SlurmctldLogFile={d / 'slurmctld.log'}",
                    f"SlurmdLogFile={d / 'slurmd-%n.log'}",
                    f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                    f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "KillWait=5",
                    # Two real cores: CPUs=16 lets a job hold more tasks than that.
                    "SlurmdParameters=config_overrides",
                    *node_lines,
                    f"PartitionName=debug Nodes={','.join(self.addresses)} Default=YES MaxTime=INFINITE "
                    "State=UP OverSubscribe=FORCE:8",
                    "",
                ]
            )
        )

    def _pid(self, name: str, timeout: float = 10.0) -> int:
        path = self.dir / name
        deadline = time.monotonic() + timeout
        while not path.exists() or not path.read_text().strip():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name}: {self.log_tail()}")
            time.sleep(0.05)
        return int(path.read_text().split()[0])

    def _wait_idle(self, nodes: list[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sinfo = ["sinfo", "-h", "-N", "-o", "%N %t"]
            out = subprocess.run(sinfo, capture_output=True, text=True, env=self.env(), timeout=30).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in nodes):
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes not idle: {states}\n{self.log_tail()}")

    def log_tail(self) -> str:
        parts = []
        for log in sorted(self.dir.glob("slurm*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def processes(self) -> list[int]:
        """Every live process of this cluster but its daemons (and their helpers, like slurmctld's
        slurmscriptd): slurmstepd, the tasks, their children."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in self._daemon_pids or parent_pid(pid) in self._daemon_pids or not _alive(pid):
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(pid)
        return found

    def stop(self) -> None:
        env = self.env()
        if self.conf.exists():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
                deadline = time.monotonic() + 20
                while (
                    time.monotonic() < deadline
                    and subprocess.run(
                        ["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30
                    ).stdout.strip()
                ):
                    time.sleep(0.2)
        for pid in reversed(self._daemon_pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in self._daemon_pids):
            time.sleep(0.05)
        for pid in [*self._daemon_pids, *self.processes()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._daemon_pids = []
        if self.ns:
            subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=10)
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=10)
            self.ns = None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])
