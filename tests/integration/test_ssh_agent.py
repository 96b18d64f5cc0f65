"""The remote agent (graph/targets/local/remote/agent.py, agent_run.py) run here as ssh would run it: a
real subprocess fed on stdin. It must stop its process when told, when its stdin closes (the
supervisor or the connection is gone) and nobody re-attaches in time, and when it is itself
killed; keep env values off command lines; and hand its process to `attach` over a new channel."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dynamo_graph
from dynamo_graph.graph.targets.local.remote import agent, agent_run
from tests.support.processes import pid_alive
from tests.support.waiting import wait_for

SECRET = "agent-secret-value"
SLEEPER = "import os, signal, time; print(os.environ['S'], flush=True); time.sleep(60)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER.replace(
    "os.environ['S']", "'up'"
)


def _wait_gone(pid: int) -> None:
    wait_for(lambda: not pid_alive(pid), 5, f"process {pid} to end")


def _written(pid: int) -> int:
    """Bytes the process has written so far, whoever reads them (/proc/PID/io)."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["wchar"])


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator:
    started: list[subprocess.Popen[bytes]] = []

    def start(
        code: str, grace: float = 5.0, tag: str = "dg-test/p-0", heartbeat: float = 0.0, reattach: float = 0.0
    ) -> tuple[subprocess.Popen[bytes], int]:
        proc = subprocess.Popen(
            [sys.executable, "-m", agent.MODULE, "run"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        started.append(proc)
        request = agent.run_request(
            [sys.executable, "-c", code], {"S": SECRET}, str(tmp_path), tag, grace, heartbeat, reattach
        )
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write(request.encode())
        proc.stdin.flush()
        words = proc.stderr.readline().decode().split()
        assert words[0] == "pid", words
        return proc, int(words[1])

    yield start
    for proc in started:  # children of this test only
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_output_pid_and_stop_when_stdin_closes(start_agent) -> None:
    proc, pid = start_agent(SLEEPER)
    assert proc.stdout.readline().decode().strip() == SECRET  # the env reached the process...
    assert SECRET.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()  # ...not its command line
    assert SECRET.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # its own session
    proc.stdin.close()  # what a dropped ssh connection looks like from the agent
    _wait_gone(pid)
    assert proc.stderr.read().decode().split() == ["exit", str(-signal.SIGTERM)]
    assert proc.wait(5) == 0


def test_term_escalates_to_sigkill_after_the_grace(start_agent) -> None:
    proc, pid = start_agent(STUBBORN, grace=0.5)
    assert proc.stdout.readline().strip() == b"up"
    started = time.monotonic()
    proc.stdin.write(b"term\n")
    proc.stdin.flush()
    assert proc.stderr.readline().decode().split() == ["exit", str(-signal.SIGKILL)]
    assert 0.4 < time.monotonic() - started < 5
    assert not pid_alive(pid)


def test_a_silent_supervisor_counts_as_gone(start_agent) -> None:
    proc, pid = start_agent(SLEEPER, heartbeat=0.2)
    assert proc.stdout.readline().decode().strip() == SECRET
    for _ in range(5):  # pinged: it keeps running
        proc.stdin.write(b"ping\n")
        proc.stdin.flush()
        time.sleep(0.2)  # the heartbeat's pace, not a wait for something to happen
    assert pid_alive(pid)
    started = time.monotonic()  # no ping for 3 heartbeats (a partition, stdin still open): stopped
    _wait_gone(pid)
    assert 0.3 < time.monotonic() - started < 3
    assert proc.stderr.read().decode().split() == ["exit", str(-signal.SIGTERM)]


COUNTER = (
    "import itertools, time\nfor i in itertools.count():\n    print(i, flush=True)\n    time.sleep(0.05)"
)


def _attach(tag: str) -> subprocess.Popen[bytes]:
    """`attach` as a new ssh channel runs it: its own stdin, stdout and stderr."""
    return subprocess.Popen(
        [sys.executable, "-m", agent.MODULE, "attach", tag],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_a_lost_channel_is_re_attached_with_the_output_kept_meanwhile(start_agent) -> None:
    tag = f"dg-test-{os.getpid()}/re-0"
    proc, pid = start_agent(COUNTER, tag=tag, reattach=10.0)
    assert proc.stdout.readline() == b"0\n"
    proc.stdin.close()  # the connection is cut: the process goes on, its output kept
    time.sleep(0.5)  # a non-event (it is not stopped) can only be checked after a while
    assert pid_alive(pid)
    again = _attach(tag)
    try:
        assert again.stderr.readline().decode().split()[:2] == ["pid", str(pid)]
        numbers = [int(again.stdout.readline()) for _ in range(20)]
        assert numbers == list(range(numbers[0], numbers[0] + 20))  # nothing lost in between
        assert numbers[0] <= 3  # what it printed while detached came first
        again.stdin.write(b"term\n")  # the re-attached channel is the supervisor's now
        again.stdin.flush()
        assert again.stderr.readline().decode().split() == ["exit", str(-signal.SIGTERM)]
        assert again.wait(10) == 0 and proc.wait(10) == 0
    finally:
        if again.poll() is None:
            again.kill()
            again.wait(10)
    assert not pid_alive(pid)


def test_a_process_ended_while_detached_is_reported_to_whoever_re_attaches(start_agent) -> None:
    tag = f"dg-test-{os.getpid()}/re-1"
    proc, pid = start_agent("import sys, time; time.sleep(0.3); sys.exit(3)", tag=tag, reattach=10.0)
    proc.stdin.close()
    _wait_gone(pid)
    again = _attach(tag)
    _, err = again.communicate(timeout=10)
    assert err.decode().split() == ["pid", str(pid), "0", "exit", "3"]
    assert proc.wait(10) == 0


def test_output_kept_while_detached_is_bounded_and_the_loss_said(start_agent) -> None:
    """Beyond SPOOL_MAX the oldest output goes; the re-attached channel first says how much."""
    tag = f"dg-test-{os.getpid()}/re-3"
    lines = agent_run.SPOOL_MAX // 50 + 20_000  # 50-byte lines, about 1 MiB more than is kept
    code = (
        "import sys, time\n"
        "print('started', flush=True); time.sleep(0.5)\n"
        f"sys.stdout.write(''.join('%049d\\n' % i for i in range({lines}))); sys.stdout.flush()\n"
        "print('done', flush=True); time.sleep(60)\n"
    )
    proc, pid = start_agent(code, tag=tag, reattach=10.0)
    assert proc.stdout.readline() == b"started\n"
    proc.stdin.close()
    proc.stdout.close()  # nobody reads the old channel any more
    total = len(b"started\n") + lines * 50 + len(b"done\n")
    wait_for(lambda: _written(pid) >= total, 30, "the process to write everything while detached")
    again = _attach(tag)
    try:
        assert again.stderr.readline().decode().split()[:2] == ["pid", str(pid)]
        first = again.stdout.readline().decode()
        assert first.startswith("dyngraph: ") and first.endswith(" bytes of output lost while detached\n")
        kept = b""
        while not kept.endswith(b"done\n"):
            kept += again.stdout.read1(65536)
        assert agent_run.SPOOL_MAX - 50 <= len(kept) <= agent_run.SPOOL_MAX
        assert kept.endswith(b"%049d\ndone\n" % (lines - 1))
        assert int(first.split()[1]) + len(kept) == lines * 50 + len(b"done\n")
        again.stdin.write(b"term\n")
        again.stdin.flush()
        assert again.stderr.readline().decode().split() == ["exit", str(-signal.SIGTERM)]
    finally:
        if again.poll() is None:
            again.kill()
        again.wait(10)


def test_nobody_re_attaching_in_time_stops_the_process(start_agent) -> None:
    tag = f"dg-test-{os.getpid()}/re-2"
    proc, pid = start_agent(SLEEPER, tag=tag, reattach=0.5)
    assert proc.stdout.readline().decode().strip() == SECRET
    proc.stdin.close()
    started = time.monotonic()
    _wait_gone(pid)
    assert time.monotonic() - started > 0.4
    assert proc.wait(10) == 0
    late = _attach(tag)
    assert late.communicate(timeout=10)[1] == b"gone\n" and late.returncode == 3
    assert not agent_run.socket_path(tag).parent.exists()  # its graph's folder too


def test_killing_the_agent_kills_its_process(start_agent) -> None:
    proc, pid = start_agent(SLEEPER)
    proc.kill()
    _wait_gone(pid)


def test_scan_finds_and_stops_a_graph_s_processes(start_agent) -> None:
    proc, pid = start_agent(STUBBORN, tag="dg-scan-test/w-0")
    assert proc.stdout.readline().strip() == b"up"

    def scan(*args: str) -> dict[str, str]:
        out = subprocess.run(
            [sys.executable, "-m", agent.MODULE, "scan", *args], capture_output=True, text=True, timeout=30
        )
        return json.loads(out.stdout)

    assert scan("dg-scan-test/") == {str(pid): "dg-scan-test/w-0"}
    assert scan("dg-other/") == {}
    assert scan("dg-scan-test/", "--kill", "0.3") == {}  # it ignores SIGTERM: SIGKILL after the grace
    assert not pid_alive(pid)


def test_scan_kill_clears_the_sockets_that_killed_agents_left(start_agent) -> None:
    tag = f"dg-clear-{os.getpid()}/w-0"
    proc, pid = start_agent(SLEEPER, tag=tag, reattach=10.0)
    path = agent_run.socket_path(tag)
    assert path.exists() and path.parent.name == f"dg-clear-{os.getpid()}"
    assert path.parent.stat().st_mode & 0o777 == 0o700
    proc.kill()  # SIGKILL: nothing of the agent's own cleanup runs
    _wait_gone(pid)
    assert path.exists()
    out = subprocess.run(
        [sys.executable, "-m", agent.MODULE, "scan", tag.split("/")[0] + "/", "--kill", "0.1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert json.loads(out.stdout) == {}
    assert not path.exists() and not path.parent.exists()


def test_probe_reports_versions_paths_gpus_and_taken_ports(tmp_path: Path) -> None:
    """`probe` as preflight runs it; GPUs counted from `nvidia-smi -L` (a stand-in printing what
    the real one prints on a machine with two GPUs, one split by MIG)."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        '#!/bin/sh\n[ "$1" = -L ] || exit 2\n'
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)'\n"
        "echo '  MIG 3g.40gb     Device  0: (UUID: MIG-cccc)'\n"
    )
    smi.chmod(0o755)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ask = {
            "paths": [str(tmp_path), str(tmp_path / "missing")],
            "gpus": True,
            "ports": [["0.0.0.0", port]],
        }
        out = subprocess.run(
            [sys.executable, "-m", agent.MODULE, "probe"],
            input=json.dumps(ask) + "\n",
            capture_output=True,
            text=True,
            env={**os.environ, "PATH": f"{smi.parent}:{os.environ['PATH']}"},
            timeout=30,
        )
    found = json.loads(out.stdout)
    assert found["gpus"] == 2 and found["gpu_note"] == ""
    assert found["missing"] == [str(tmp_path / "missing")]
    assert found["taken"] == [["0.0.0.0", port]]
    assert found["version"] == dynamo_graph.__version__
