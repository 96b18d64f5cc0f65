"""Connections lost while the frontends on one port hand over: two `dyngraph run in=http`
processes share the port (SO_REUSEPORT), clients open a fresh connection for every request, and
each round starts a new process, waits until it answers, then SIGTERMs the oldest. A connection
the kernel had queued on a listener as it closed is reset; the server takes its backlog before
closing (frontend/server.py), so what is left is the kernel's microseconds.

    python benchmarks/bench_frontend_handover.py --rounds 40
Results: benchmarks/results/frontend_handover.json (with the commit and the machine).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import free_port

from dynamo_graph.bench.provenance import git_of, provenance
from dynamo_graph.bench.report import write_json

RUN = [sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=echo_full", "--model-name", "echo"]
READY_S = 30.0
MAX_SECONDS = 600.0  # the whole load's bound, whatever the rounds


class Load:
    """`clients` threads, each a request per new connection (`Connection: close`) until stopped."""

    def __init__(self, port: int, clients: int) -> None:
        self.port = port
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.deadline = time.monotonic() + MAX_SECONDS
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(clients)]

    def loop(self) -> None:
        while not self.stopping.is_set() and time.monotonic() < self.deadline:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                conn.request("GET", "/v1/models", headers={"Connection": "close"})
                conn.getresponse().read()
                with self.lock:
                    self.ok += 1
            except OSError as err:
                with self.lock:
                    self.failures.append(f"{type(err).__name__}: {err}")
            finally:
                conn.close()


def start(port: int) -> subprocess.Popen:
    argv = [*RUN, "--http-port", str(port)]
    quiet = subprocess.DEVNULL
    return subprocess.Popen(argv, stdout=quiet, stderr=quiet, start_new_session=True)


def wait_answering(port: int, proc: subprocess.Popen) -> None:
    """Until `proc` itself answers /health (its pid in the header), not the other one on the port."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"frontend {proc.pid} exited with {proc.returncode}"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            answer = conn.getresponse()
            answer.read()
            if answer.status == 200 and answer.getheader("x-dyngraph-pid") == str(proc.pid):
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    raise TimeoutError(f"frontend {proc.pid} did not answer within {READY_S} s")


def handovers(port: int, rounds: int, clients: int) -> dict:
    procs = [start(port), start(port)]
    try:
        for proc in procs:
            wait_answering(port, proc)
        load = Load(port, clients)
        started = time.monotonic()
        for thread in load.threads:
            thread.start()
        for _ in range(rounds):
            time.sleep(0.5)
            procs.append(start(port))
            wait_answering(port, procs[-1])
            old = procs.pop(0)
            old.send_signal(signal.SIGTERM)
            old.wait(timeout=60)
        time.sleep(0.5)
        load.stopping.set()
        for thread in load.threads:
            thread.join(timeout=30)
        seconds = time.monotonic() - started
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
    return {
        "rounds": rounds,
        "clients": clients,
        "requests_ok": load.ok,
        "requests_failed": len(load.failures),
        "connections_per_s": round((load.ok + len(load.failures)) / seconds),
        "seconds": round(seconds, 1),
        "failures": load.failures[:10],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="new process, then the oldest stopped")
    parser.add_argument("--clients", type=int, default=8, help="threads, each a new connection per request")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "frontend_handover.json"))
    args = parser.parse_args()
    measured = handovers(free_port(), args.rounds, args.clients)
    result = {
        "benchmark": "connections_lost_while_frontends_on_one_port_hand_over",
        **provenance(),
        "git": git_of(Path(__file__)),
        **measured,
    }
    print(json.dumps(measured, indent=2))
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
