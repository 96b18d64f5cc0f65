"""Plan -> running processes: launch (local.py), readiness (probes.py), restart and diff-apply
(supervisor.py), the control socket (control.py), the state dir (state.py), and the client side
of `dyngraph up | status | logs | down` (commands.py)."""
