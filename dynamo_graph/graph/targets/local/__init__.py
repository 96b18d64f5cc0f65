"""The local target: a plan's processes on this machine and on ssh hosts, kept running by a
supervisor (foreground, or detached with `up -d`).

The commands, run in the `dyngraph` process:
    target.py     the target: `up` (incl. `--dry-run`), `status`, `logs`, `down`, `render -f shell`
    commands.py   their client side: start or reach the supervisor, wait, print, stop, check
    preflight.py  what would fail on the graph's hosts, found before anything starts
    diff.py       `dyngraph diff` / `up --dry-run`: what `up` would change, per process
    listing.py    `dyngraph ls`: the graphs running on this machine
    shell.py      `render -f shell`: the plan as a script to run by hand
    ui.py         the status table, frontend URLs, prefixed log lines
    logs.py       reading logs: last lines, interleaved by time, followed

The supervisor:
    daemon.py     its whole life (`python -m ...daemon STATE_DIR` when detached)
    supervisor.py one runner per process: dependency order, readiness, restarts, apply a new plan
    changes.py    what making a plan the running one starts, restarts and stops
    control.py    its control socket (apply, stop)
    process.py    one process on this host, stopped without signalling a stranger
    probes.py     readiness probes (http, tcp, log)
    ports.py      `{port:NAME}` placeholders -> free ports, stable while it runs
    state.py      the graph's state dir (plan, process records, pid, logs); Slurm writes it too
    registry.py   which graphs run on this machine (for `ls`)

    remote/       processes on ssh hosts: the ssh launcher and the agent it runs there
"""
