"""A supervisor's whole life, in the foreground (`dyngraph up`) or detached (`up -d`):

    python -m dynamo_graph.graph.targets.local.daemon STATE_DIR

The detached one starts with an empty plan; `up -d` then sends it the plan over the control
socket, exactly as a later `up` sends a changed one. Both kinds write `supervisor.pid`, listen
on the control socket, and on `stop`, SIGINT or SIGTERM stop every process in reverse
dependency order before removing the pid and socket files.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local import control, registry
from dynamo_graph.graph.targets.local.planner import Autoscaler, SupervisorPools
from dynamo_graph.graph.targets.local.revisions import origin_of
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.local.sup_metrics import follow, metrics_server
from dynamo_graph.graph.targets.local.supervisor import Refused, Report, Supervisor

# Runtime data of the previous run of the graph (file discovery, managed etcd / nats storage):
# a fresh supervisor starts from empty so no dead instance of last time is routed to.
FRESH_DIRS = ("discovery", "etcd", "nats")


async def supervise(
    state: StateDir,
    report: Report,
    plan: Plan | None = None,
    alongside: Callable[[Supervisor], Awaitable[None]] | None = None,
    command: str = "up",
) -> None:
    """Run until a `stop` request, SIGINT or SIGTERM, then stop everything. `alongside` (the
    foreground's log streaming, `dyngraph test`'s checks) runs meanwhile: when it returns, the
    graph stops too; if still running, it is cancelled once every process stopped."""
    state.ensure()
    for name in FRESH_DIRS:
        shutil.rmtree(state.root / name, ignore_errors=True)
    state.write_pid(os.getpid())
    registry.enter(state.root)  # `dyngraph ls` lists it
    sup = Supervisor(state, report)
    planner = Autoscaler(SupervisorPools(sup))
    metrics = metrics_server(sup, planner)
    shutdown = asyncio.Event()

    async def handle(req: control.Request) -> control.Reply:
        if isinstance(req, control.Stop):
            shutdown.set()
            return control.Reply(ok=True)
        try:
            changes, revision = await sup.apply(req.plan, req.origin)
        except Refused as refused:
            return control.Reply(ok=False, error=str(refused))
        report("dyngraph", f"revision {revision}: " + (", ".join(changes) or "no changes"))
        await follow(metrics, req.plan)
        return control.Reply(ok=True, changes=changes, revision=revision)

    server = await control.serve(state.control_socket, handle)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.set)
    extra: asyncio.Task[None] | None = None
    autoscaler = asyncio.create_task(planner.run(), name="autoscaler")
    try:
        if plan is not None:
            await sup.apply(plan, origin_of(plan.graph_file, command))
            await follow(metrics, plan)
        if alongside is not None:
            extra = asyncio.ensure_future(alongside(sup))
            extra.add_done_callback(lambda _: shutdown.set())
        await shutdown.wait()
    finally:
        server.close()
        await metrics.close()
        report("dyngraph", "stopping")
        autoscaler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await autoscaler
        await sup.stop_all()
        if extra is not None:
            extra.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await extra
        state.clear_runtime_files()
        registry.leave(state.root)
        report("dyngraph", "stopped")


def _print_report(process: str, message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {process}: {message}", flush=True)


def main() -> None:
    asyncio.run(supervise(StateDir(sys.argv[1]), _print_report))


if __name__ == "__main__":
    main()
