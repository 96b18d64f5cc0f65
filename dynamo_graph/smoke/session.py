"""One graph's test: bring it up isolated through the supervisor `dyngraph up` runs, wait until
it serves, run its checks in order, and tear it down whatever happens.

The supervisor runs in this process (`supervise`, as in `dyngraph up` in the foreground) with
the checks alongside; when they end, it stops every process in reverse dependency order. Ctrl-C
(or a CI job's cancellation: SIGTERM) cancels the checks, which ends the run the same way, and
the run is reported as interrupted. A process that exits before the graph
is up means the graph did not come up, even if its restart policy would try again: a smoke test
wants to hear about a worker that cannot start at once, with its last log lines, not after a
crash loop's backoff.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape

from dynamo_graph.graph.build import Built
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local.daemon import supervise
from dynamo_graph.graph.targets.local.logs import tail_lines
from dynamo_graph.graph.targets.local.ports import listening, plan_ports
from dynamo_graph.graph.targets.local.process import pid_alive
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.local.supervisor import Supervisor
from dynamo_graph.graph.targets.local.ui import frontend_url
from dynamo_graph.smoke.defaults import default_checks, served_models
from dynamo_graph.smoke.report import print_check
from dynamo_graph.smoke.results import CheckResult, GraphResult
from dynamo_graph.smoke.steps import Address, Target, api_key_headers, run_check, wait_models

FAILURE_LOG_LINES = 30
POLL_S = 0.02


class Session:
    """The run of one built graph with its isolated plan; fills `result`."""

    def __init__(
        self, built: Built, plan: Plan, result: GraphResult, console: Console, verbose: bool
    ) -> None:
        self.built = built
        self.plan = plan
        self.result = result
        self.console = console
        self.verbose = verbose
        self.state = StateDir(plan.state_dir)
        self.events: list[str] = []

    def report(self, process: str, message: str) -> None:
        """The supervisor's events (ready, exited, restarting): shown with -v, and in the JUnit
        report of a graph that did not come up."""
        self.events.append(f"{process}: {message}")
        if self.verbose:
            self.console.print(f"  [dim]{escape(process)}: {escape(message)}[/]", highlight=False)

    def run(self) -> None:
        asyncio.run(supervise(self.state, self.report, self.plan, alongside=self._alongside, command="test"))
        self._check_teardown()

    async def _alongside(self, sup: Supervisor) -> None:
        """The checks, which SIGINT / SIGTERM cancel: their end stops the graph. (The supervisor's
        own handlers would stop the processes first, and a frontend draining its requests could
        let a check finish as if nothing had happened.)"""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._interrupt, task, sig)
        try:
            await self._checks(sup)
        except asyncio.CancelledError:
            self.result.interrupted = True
            raise

    def _interrupt(self, task: asyncio.Task[None], sig: signal.Signals) -> None:
        if not task.done():
            self.console.print(f"  [yellow]{sig.name}: stopping the graph[/]", highlight=False)
            task.cancel()

    async def _checks(self, sup: Supervisor) -> None:
        started = time.monotonic()
        count = len(self.plan.processes)
        where = f" (state: {self.plan.state_dir})" if self.verbose else ""
        self.console.print(
            f"  starting {count} process{'es' if count != 1 else ''}{escape(where)}", highlight=False
        )
        failed = await self._wait_up(sup)
        if failed is not None:
            self._up_failed(*failed, time.monotonic() - started)
            return
        frontends = self._frontends(sup)
        async with httpx.AsyncClient(timeout=None) as client:
            graph = self.built.graph
            deployed = {graph.models[w.model].name for w in graph.workers().values() if w.replicas}
            wanted = {k: [m for m in served_models(graph, k) if m in deployed] for k in frontends}
            if missing := await wait_models(client, graph, frontends, wanted):
                self._up_failed("models", missing, "", time.monotonic() - started)
                return
            self.console.print(f"  up in {time.monotonic() - started:.2f} s", highlight=False)
            target = Target(graph, sup, frontends, client)
            for index, check in enumerate(graph.tests if graph.tests is not None else default_checks(graph)):
                outcome = await run_check(target, check, index)
                self.result.checks.append(outcome)
                print_check(self.console, outcome)

    async def _wait_up(self, sup: Supervisor) -> tuple[str, str, str] | None:
        """None once every process is ready; else (process, why, its last log lines)."""
        names = [p.name for p in self.plan.processes]
        longest = max((p.readiness.timeout_s for p in self.plan.processes), default=0.0)
        deadline = time.monotonic() + longest * max(len(names), 1) + 10.0
        while time.monotonic() < deadline:
            runners = [sup.runners[n] for n in names if n in sup.runners]
            for runner in runners:
                record = runner.record
                if record.state in ("restarting", "failed", "exited") or record.restarts:
                    why = record.message or f"exited with {record.last_exit}"
                    return runner.spec.name, why, self._tail(runner.spec.name)
            if len(runners) == len(names) and all(r.ready.is_set() for r in runners):
                return None
            await asyncio.sleep(POLL_S)
        waiting = [n for n in names if n not in sup.runners or not sup.runners[n].ready.is_set()] or names
        return waiting[0], "not ready in time", self._tail(waiting[0])

    def _tail(self, process: str) -> str:
        return "\n".join(tail_lines(self.state.log_file(process), FAILURE_LOG_LINES))

    def _frontends(self, sup: Supervisor) -> dict[str, Address]:
        """Each frontend's `http://host:port` from the running plan (its `auto` ports filled), and
        an API key from the variables its `api_key_env` names (as `up` passes them on)."""
        frontends: dict[str, Address] = {}
        for spec in (sup.plan or self.plan).processes:
            if (url := frontend_url(spec)) is None or spec.component in frontends:
                continue
            headers = api_key_headers(self.built.graph, spec.component)
            frontends[spec.component] = Address(url.split(" on host ")[0].removesuffix("/v1"), headers)
        return frontends

    def _up_failed(self, process: str, why: str, log: str, seconds: float) -> None:
        self.result.up_failure = f"{process}: {why}"
        output = "\n".join(
            ["supervisor:", *self.events, "", f"last log lines of {process}:", log] if log else self.events
        )
        self.result.checks.append(
            CheckResult("up", "error", seconds, [self.result.up_failure], output=output)
        )
        self.console.print(
            f"  [bold red]did not come up:[/] {escape(self.result.up_failure)}", highlight=False
        )
        if log:
            self.console.print(f"  last log lines of {escape(process)}:", highlight=False)
            for line in log.splitlines():
                self.console.print(f"    {process} | {line}", highlight=False, markup=False)

    def _check_teardown(self) -> None:
        """After the supervisor stopped: no process of the plan alive, no port of it listening."""
        alive = [
            r.name
            for r in self.state.read_processes()
            if r.host == "local" and r.pid is not None and pid_alive(r.pid, r.start_ticks)
        ]
        ports = sorted(p for p in plan_ports(self.state.read_plan() or self.plan) if listening(p))
        if alive or ports:
            listed = ", ".join(map(str, ports)) or "-"
            why = f"still alive: {', '.join(alive) or '-'}; ports still listening: {listed}"
            self.result.checks.append(CheckResult("teardown", "error", 0.0, [why]))


def run_session(
    built: Built, plan: Plan, result: GraphResult, console: Console, *, verbose: bool, keep_state: bool
) -> None:
    """Run the graph's test; its state dir goes afterwards unless something failed (or kept)."""
    session = Session(built, plan, result, console, verbose)
    started = time.monotonic()
    try:
        session.run()
    finally:
        result.seconds = time.monotonic() - started
        if keep_state or result.status not in (0, 130):
            result.state_dir = plan.state_dir
        else:
            shutil.rmtree(Path(plan.state_dir), ignore_errors=True)
