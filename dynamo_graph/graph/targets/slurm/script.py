"""The sbatch script of a graph: its launch plan as one Slurm job, each process an `srun` step.

The plan is the compiler's (compile.py), compiled with each host's address left as a
`{node:HOST}` placeholder; the script fills those from the allocation (`NodeAddr` of the node a
host key became, nodes.py) and `{port:NAME}` placeholders with ports free on the owning node,
then starts every process as a step on its node, in dependency order, restarted by its policy.

What the job leaves for `status`, `logs` and `down` lives in the graph's state dir, which the
nodes must share (as Slurm's own `--output` files are usually shared):

    logs/<process>.log         each step's output (appended across restarts, with start markers)
    slurm/job/resolved.env     the nodes, their addresses and the ports picked (shell words)
    slurm/job/steps/<process>  one event a line: `start TS RUN LAUNCH`, `ready TS`, `unready TS`,
                               `exit RC TS`, `crashloop TS`, `blocked TS DEPENDENCY`, `replace TS`,
                               `down TS RANK` (another rank of its replica ended: this run is
                               taken down with it) (LAUNCH: the md5 prefix of the `.cmd` the run
                               started with)
    slurm/job/steps/<process>.cmd  the process's launch, read at each (re)start: `up` rolls a
                               step by rewriting it and stopping the run (rollout.py)
    slurm/job/steps/<process>.off  while it exists, the process does not run (an `off TS` event):
                               an autoscaled pool's standby replicas start with one, and the
                               job's planner (slurm/autoscale.py) removes it to grow the pool,
                               or writes it and stops the step to retire a replica

The ranks of a multi-node replica (a worker's `nodes`) are one step each on their nodes, joined
by the leader's rendezvous, and live and die as a group as on the local target (local/gang.py):
a rank whose run ends on its own takes the others' steps down, and each rank starts again only
once no other runs a run older than its own exit, so the group meets at a new rendezvous.

An autoscaled pool's allocation holds its `max_replicas`: the standby replicas are steps that
wait for their `.off` to go, so the planner grows the pool within the job's nodes.

The text is a pure function of the graph and where its file lives (snapshot-tested). No secret
is written into it: an env value whose name looks secret is read from a variable of the job's
environment (`DYNGRAPH_SECRET_<n>`), which `up --target slurm` sets for sbatch.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamo_graph.graph.compile import compile_graph
from dynamo_graph.graph.errors import GraphError, Location, Problem
from dynamo_graph.graph.plan import LOCAL, Plan, ProcessSpec
from dynamo_graph.graph.schema import Graph, Slurm
from dynamo_graph.redact import is_secret_name

SECRET_VAR = "DYNGRAPH_SECRET_"
JOB_DIR = "slurm/job"  # under the state dir: the running job's records (see the module docstring)
_PLACEHOLDER = re.compile(r"\{(port|node):([^}]+)\}")
_LOOPBACK = re.compile(r"(//|^)(127\.0\.0\.1|localhost|0\.0\.0\.0)(?=:)")  # in a probe's target

PLANNER = (
    '"$PY" -m dynamo_graph.graph.targets.slurm.autoscale "$STATE" "$SLURM_JOB_ID" '
    '>> "$STATE/logs/planner.log" 2>&1 &'
)
_FUNCTIONS = r"""
node_addr() { scontrol show node "$1" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'; }

# run_step NAME POLICY MAX_RESTARTS BACKOFF_S BACKOFF_MAX_S [PEER...]: one process as a step,
# restarted by its policy. Each run reads its launch from $JOB/steps/NAME.cmd (shell words: PROBE_KIND
# PROBE_TARGET PROBE_TIMEOUT_S SRUN_OPTIONS... COMMAND...), which `up` rewrites to roll the step:
# it touches NAME.replace, then stops the run; the next run starts at once, whatever the policy.
# A replacement that ends before it was ready waits (up to 30 s) for `up` to put the previous
# launch back and ask again, rather than being given up by its policy. While NAME.off exists the
# process does not run (a standby replica; a retired one is not restarted) and its policy resets.
# PEERs are the other ranks of a multi-node replica (docs/multinode.md): a run that ends on its
# own (not replaced, retired or taken down) takes theirs down; a run taken down counts as failed;
# and no rank starts again (nor is replaced) while a peer still runs a run older than its own
# exit, so the group meets at a new rendezvous.
run_step() {
  local name=$1 policy=$2 max=$3 delay=$4 delay_max=$5 run=0 rc trial=0 waited launch failed ended
  local events=$JOB/steps/$name log=$STATE/logs/$name.log replace=$JOB/steps/$name.replace
  local off=$JOB/steps/$name.off
  local -a words peers=("${@:6}")
  while :; do
    if [ -e "$off" ]; then
      echo "off $(date +%s)" >> "$events"
      while [ -e "$off" ]; do sleep 0.2; done
      run=0 delay=$4
    fi
    run=$((run + 1))
    rm -f "$replace"  # this run takes the launch as it is now
    launch=$(< "$JOB/steps/$name.cmd")
    eval "words=($launch)"
    echo "--- dyngraph: started $name (run $run) at $(date) ---" >> "$log"
    echo "start $(date +%s) $run $(printf '%s' "$launch" | md5sum | cut -c1-12)" >> "$events"
    "$PY" -m dynamo_graph.graph.targets.slurm.probe "$events" "$log" "${words[@]:0:3}" &
    srun --nodes=1 --ntasks=1 --exact --job-name="$name" --output="$log" --open-mode=append "${words[@]:3}"
    rc=$?
    ended=$(date +%s)
    echo "exit $rc $ended" >> "$events"
    waited=0
    while [ "$trial" = 1 ] && [ ! -e "$replace" ] && [ "$waited" -lt 300 ] \
        && ! awk '$1 == "start" { r = 0 } $1 == "ready" { r = 1 } END { exit !r }' "$events"; do
      sleep 0.1
      waited=$((waited + 1))
    done
    if [ -e "$replace" ]; then
      echo "replace $(date +%s)" >> "$events"
      await_down "$ended" "${peers[@]}"  # a replica's ranks are replaced together
      run=0 delay=$4 trial=1
      continue
    fi
    trial=0
    if [ -e "$off" ]; then continue; fi
    failed=$((rc != 0))
    if [ "${#peers[@]}" -gt 0 ]; then
      if awk '$1 == "start" { d = 0 } $1 == "down" { d = 1 } END { exit !d }' "$events"; then
        failed=1
      else
        take_down "$name" "${peers[@]}"
      fi
    fi
    if [ "$policy" = never ] || { [ "$policy" = on-failure ] && [ "$failed" = 0 ]; }; then return; fi
    if [ "$run" -gt "$max" ]; then echo "crashloop $(date +%s)" >> "$events"; return; fi
    await_down "$ended" "${peers[@]}"
    sleep "$delay"
    delay=$(awk -v d="$delay" -v m="$delay_max" 'BEGIN { d *= 2; print (d > m) ? m : d }')
  done
}

# cancel_step NAME: end the process's running step, if it has one (scancel: SIGTERM, and SIGKILL
# after Slurm's KillWait).
cancel_step() {
  local step
  step=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' | awk -v n="$1" '$2 == n { print $1 }')
  if [ -n "$step" ]; then scancel "$step"; fi
}

# take_down NAME PEER...: NAME's run ended on its own; end each peer's run, recording `down TS
# NAME` in its events.
take_down() {
  local peer
  for peer in "${@:2}"; do
    echo "down $(date +%s) $1" >> "$JOB/steps/$peer"
    cancel_step "$peer"
  done
}

# await_down SINCE PEER...: until no peer runs a run started before SINCE (up to 120 s), asking
# Slurm again every 5 s to end one that still does (a step not yet listed when it was taken down).
await_down() {
  local since=$1 peer waited
  for peer in "${@:2}"; do
    waited=0
    while [ "$waited" -lt 1200 ] && awk -v t="$since" \
        '$1 == "start" { r = ($2 < t) } $1 == "exit" { r = 0 } END { exit !r }' "$JOB/steps/$peer"; do
      if [ $((waited % 50)) = 49 ]; then cancel_step "$peer"; fi
      sleep 0.1
      waited=$((waited + 1))
    done
  done
}

# await_ready NAME DEPENDENCY...: until each dependency is ready; 1 (recorded) if one never will be.
await_ready() {
  local name=$1 dep
  shift
  for dep in "$@"; do
    until grep -q '^ready' "$JOB/steps/$dep" 2>/dev/null; do
      if grep -qE '^(unready|crashloop|blocked)' "$JOB/steps/$dep" 2>/dev/null \
          || { [ -e "$JOB/steps/$dep.done" ] && ! grep -q '^ready' "$JOB/steps/$dep"; }; then
        echo "blocked $(date +%s) $dep" >> "$JOB/steps/$name"
        return 1
      fi
      sleep 0.2
    done
  done
}
"""


@dataclass(frozen=True)
class Layout:
    """The allocation: host key -> node index, and what the busiest node needs."""

    hosts: list[str]  # host key of node i
    tasks_per_node: int
    gpus_per_node: int
    gpus: dict[str, int]  # process name -> GPUs of its step

    def node(self, host: str) -> int:
        return self.hosts.index(host)


def node_order(hosts: Iterable[str]) -> list[str]:
    """Host keys in the order of the job's nodes (Graph.slurm_nodes): `local` first."""
    return sorted(set(hosts), key=lambda h: (h != LOCAL, h))


def address_placeholder(host: str) -> str:
    """Where a host's node address goes in a plan compiled for Slurm; the script fills it in."""
    return "{node:" + host + "}"


def slurm_plan(graph: Graph, plan: Plan) -> Plan:
    """The graph's plan with node addresses as placeholders (compiled again: same compiler)."""
    hosts = graph.slurm_nodes()
    return compile_graph(
        graph,
        graph_file=Path(plan.graph_file),
        state_dir=Path(plan.state_dir),
        nodes={h: address_placeholder(h) for h in hosts},
    )


def layout(graph: Graph, plan: Plan) -> Layout:
    """Nodes from the graph's hosts; tasks and GPUs per node from the processes placed there."""
    hosts = graph.slurm_nodes()
    tasks = dict.fromkeys(hosts, 0)
    gpus_on = dict.fromkeys(hosts, 0)
    gpus: dict[str, int] = {}
    workers = graph.workers()
    for proc in [*plan.processes, *plan.standby]:  # standby: an autoscaled pool's room to grow
        worker = workers.get(proc.component)
        gpus[proc.name] = worker.gpus_per_node if worker is not None else 0
        for host in proc.mpi_hosts or [proc.host]:  # an MPI world's tasks on each of its nodes
            tasks[host] += proc.mpi_tasks or 1
            gpus_on[host] += gpus[proc.name]
    return Layout(hosts, max(tasks.values()), max(gpus_on.values()), gpus)


def secret_env(plan: Plan) -> dict[str, str]:
    """`DYNGRAPH_SECRET_<n>` -> value, for every distinct secret env value, which the script reads
    from the job's environment instead of holding it (numbered in plan order)."""
    out: dict[str, str] = {}
    for proc in plan.processes:
        for key, value in proc.env.items():
            if is_secret_name(key) and value and value not in out.values():
                out[f"{SECRET_VAR}{len(out)}"] = value
    return out


def python_of(graph: Graph, host: str) -> str:
    """The interpreter with dyngraph on a host's node: the host's `venv` / `python`, else this one."""
    h = graph.host(host)
    if h.venv:
        return f"{h.venv.rstrip('/')}/bin/python"
    return h.python or sys.executable


def _var(kind: str, name: str) -> str:
    return ("PORT_" if kind == "port" else "ADDR_") + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def _word(text: str) -> str:
    """A shell word of `text` with its placeholders expanded as variables."""
    quoted = shlex.quote(text)
    out = _PLACEHOLDER.sub(lambda m: "'\"$" + _var(m.group(1), m.group(2)) + "\"'", quoted)
    return out.removeprefix("''").removesuffix("''") or "''"


def _header(graph: Graph, slurm: Slurm, plan: Plan, lay: Layout) -> list[str]:
    options = [
        f"--job-name={slurm.job_name or graph.name}",
        f"--nodes={len(lay.hosts)}",
        f"--ntasks-per-node={lay.tasks_per_node}",
    ]
    if lay.gpus_per_node:
        options.append(f"--gres={slurm.gres}:{lay.gpus_per_node}")
    for flag, value in (
        ("partition", slurm.partition),
        ("account", slurm.account),
        ("qos", slurm.qos),
        ("time", slurm.time),
    ):
        if value is not None:
            options.append(f"--{flag}={value}")
    options += [f"--chdir={plan.state_dir}", f"--output={plan.state_dir}/slurm/job-%j.out", *slurm.sbatch]
    return [f"#SBATCH {shlex.quote(o)}" for o in options]


def _nodes_and_ports(graph: Graph, plan: Plan, lay: Layout) -> list[str]:
    lines = ['mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")']
    for i, host in enumerate(lay.hosts):
        lines.append(f'NODE_{i}=${{NODES[{i}]}} {_var("node", host)}=$(node_addr "${{NODES[{i}]}}")')
        lines.append(f"PY_{i}={shlex.quote(python_of(graph, host))}")
    lines.append("PY=$PY_0  # the batch step runs on the first node: readiness is checked from there")
    procs = [*plan.processes, *plan.standby]
    owner = {name: p.host for p in procs for name in p.ports}
    named = {m[1] for p in procs for t in [*p.argv, *p.env.values()] for m in _PLACEHOLDER.findall(t)}
    auto = sorted(named & set(owner))
    resolved = [v for i, h in enumerate(lay.hosts) for v in (f"NODE_{i}", _var("node", h))]
    for i, host in enumerate(lay.hosts):
        names = [n for n in auto if owner[n] == host]
        if not names:
            continue
        ask = f'"$PY_{i}" -m dynamo_graph.graph.targets.local.remote.agent ports {len(names)}'
        if i > 0:  # a port is free where it listens: ask that node
            on_node = f'--nodelist="$NODE_{i}" --job-name=dyngraph-ports'
            ask = f"srun --overlap --nodes=1 --ntasks=1 {on_node} {ask}"
        lines.append(f"read -r {' '.join(_var('port', n) for n in names)} < <({ask} | tr -d '[],')")
        resolved += [_var("port", n) for n in names]
    words = " ".join(f"{v}=${v}" for v in resolved)
    lines.append(f"printf '%s\\n' {words} > \"$JOB/resolved.env\"")
    return lines


def probe_target(proc: ProcessSpec, first_node: bool) -> str:
    """A process's readiness target as seen from the job's first node (where the probes and the
    planner run): its own on that node, at its node's address (a placeholder) on the others."""
    target = proc.readiness.target
    if first_node or proc.readiness.kind == "log":
        return target
    return _LOOPBACK.sub(r"\1" + address_placeholder(proc.host), target)


def _launch(proc: ProcessSpec, lay: Layout, slurm: Slurm) -> str:
    """A process's `NAME.cmd`: its probe, srun options and command as shell words, which each run
    of the step reads (so `up` can roll it by rewriting the file). Secret values are not in it."""
    i = lay.node(proc.host)
    probe = proc.readiness
    target = probe_target(proc, i == 0)
    srun = [f'--nodelist="$NODE_{i}"', f"--chdir={_word(proc.workdir)}"]
    if proc.mpi_hosts:  # one step over the world's nodes (later options win over run_step's)
        nodes, per = len(proc.mpi_hosts), proc.mpi_tasks
        srun[0] = "--nodelist=" + ",".join(f'"$NODE_{lay.node(h)}"' for h in proc.mpi_hosts)
        srun += [f"--nodes={nodes}", f"--ntasks={nodes * per}", f"--ntasks-per-node={per}"]
        srun += ["--mpi=pmix", "--kill-on-bad-exit=1"]  # a task that dies ends the world: it restarts whole
    if lay.gpus_per_node:  # a step has only the GPUs it asks for
        gpus = lay.gpus[proc.name]
        srun.append(f"--gres={slurm.gres}:{gpus}" if gpus else "--gres=none")
    env = ["PYTHONUNBUFFERED=1"]
    for key, value in proc.env.items():
        if key == "CUDA_VISIBLE_DEVICES" or (is_secret_name(key) and value):
            continue  # Slurm binds the step's GPUs and sets it; a secret comes from the job's environment
        env.append(f"{key}={_word(value)}")
    argv, launcher = proc.argv, []
    if argv[0] == "trtllm-llmapi-launch":  # installed beside the node's Python by TensorRT-LLM's wheel
        argv, launcher = argv[1:], [f'"$(dirname "$(command -v "$PY_{i}")")"/trtllm-llmapi-launch']
    command = launcher + (
        [f'"$PY_{i}"', "-m", "dynamo_graph", *map(_word, argv[1:])]
        if argv[0] == "dyngraph"
        else [*map(_word, argv)]
    )
    probe_words = f"{probe.kind} {_word(target)} {probe.timeout_s:g}"
    return " \\\n  ".join([probe_words, " ".join(srun), "env " + " ".join(env), " ".join(command)])


def launches(graph: Graph, plan: Plan) -> dict[str, str]:
    """Process name -> its `NAME.cmd` text, for the plan compiled for Slurm (slurm_plan)."""
    assert graph.slurm is not None, "render_slurm refuses a graph without `slurm:`"
    lay = layout(graph, plan)
    return {p.name: _launch(p, lay, graph.slurm) for p in [*plan.processes, *plan.standby]}


def secret_exports(proc: ProcessSpec, secrets: dict[str, str]) -> list[str]:
    """`KEY="$DYNGRAPH_SECRET_<n>"` for each secret env value of a process: srun passes its
    environment on, so no secret is in any argv or file."""
    return [
        f'{key}="${next(v for v, s in secrets.items() if s == value)}"'
        for key, value in proc.env.items()
        if is_secret_name(key) and value
    ]


def _step(
    proc: ProcessSpec, launch: str, secrets: dict[str, str], standby: bool, peers: list[ProcessSpec]
) -> str:
    r = proc.restart
    head = ["run_step", proc.name, r.policy, str(r.max_restarts), f"{r.backoff_s:g}", f"{r.backoff_max_s:g}"]
    head += [p.name for p in peers]  # a multi-node replica's other ranks: its group
    waits = f"await_ready {proc.name} {' '.join(proc.depends_on)} && " if proc.depends_on else ""
    exports = secret_exports(proc, secrets)
    export = f"export {' '.join(exports)}; " if exports else ""  # in this process's subshell only
    cmd_file = f'"$JOB/steps/{proc.name}.cmd"'
    run = f'{{ {export}{waits}{" ".join(head)}; touch "$JOB/steps/{proc.name}.done"; }} &'
    off = f'touch "$JOB/steps/{proc.name}.off"\n' if standby else ""
    return f"{off}cat > {cmd_file} <<'EOF'\n{launch}\nEOF\n{run}"  # off first: a launch without it runs


def render_slurm(graph: Graph, plan: Plan) -> str:
    """The sbatch script (deterministic text). Raises GraphError for a graph without a `slurm:`
    section: the section is what validates it for Slurm (hosts as nodes, GPUs by GRES)."""
    slurm = graph.slurm
    if slurm is None:
        raise GraphError(
            [
                Problem(
                    "slurm",
                    "the Slurm target needs a `slurm:` section (`slurm: {}` for the cluster's defaults, or "
                    "`+slurm.partition=NAME` on the command line)",
                    Location(plan.graph_file),
                )
            ]
        )
    plan = slurm_plan(graph, plan)
    lay = layout(graph, plan)
    secrets = secret_env(plan)
    lines = [
        "#!/bin/bash",
        *_header(graph, slurm, plan, lay),
        f"# dyngraph graph {plan.graph!r} ({plan.graph_file}) as one Slurm job: {len(plan.processes)} "
        f"processes on {len(lay.hosts)} node(s) ({', '.join(lay.hosts)}), each an srun step.",
        f"# Submit with `dyngraph up --target slurm {plan.graph_file}`; `status`, `logs`, `down` follow it.",
    ]
    if secrets:
        lines.append(f"# Secret env values come from the job's environment: {', '.join(secrets)}.")
    lines += [
        "set -uo pipefail",
        f"STATE={shlex.quote(plan.state_dir)}",
        f"JOB=$STATE/{JOB_DIR}",
        'rm -rf "$JOB" && mkdir -p "$JOB/steps" "$STATE/logs"',
        _FUNCTIONS.strip("\n"),
        "",
        *_nodes_and_ports(graph, plan, lay),
    ]
    for path, text in plan.files.items():
        lines.append(f"mkdir -p {shlex.quote(str(Path(path).parent))}")
        lines.append(f"cat > {shlex.quote(path)} <<'EOF'\n{text.rstrip()}\nEOF")
    texts = launches(graph, plan)
    every = [*plan.processes, *plan.standby]
    for proc in every:
        standby = proc in plan.standby
        where = f"# {proc.name} on {proc.host} (node {lay.node(proc.host)})"
        lines += ["", f"{where}, standby" if standby else where]
        peers = [p for p in every if proc.group and p.group == proc.group and p is not proc]
        lines.append(_step(proc, texts[proc.name], secrets, standby, peers))
    if plan.autoscale:
        lines += ["", "# the planner of the autoscaled pools, beside the steps (slurm/autoscale.py)", PLANNER]
    lines += ["", "wait"]
    return "\n".join(lines) + "\n"


def fill_text(text: str, resolved: dict[str, str]) -> str:
    """`text` with the addresses and ports the job picked in place of its placeholders."""
    return _PLACEHOLDER.sub(lambda m: resolved.get(_var(m.group(1), m.group(2)), m.group(0)), text)


def fill_plan(plan: Plan, resolved: dict[str, str]) -> Plan:
    """The plan with the addresses and ports the job picked (its `resolved.env`) in place of the
    placeholders, and each process's host shown with its node: what `status` and `logs` read."""

    def sub(text: str) -> str:
        return fill_text(text, resolved)

    def fill(proc: ProcessSpec) -> ProcessSpec:
        ports = {k: int(resolved.get(_var("port", k), 0)) or v for k, v in proc.ports.items()}
        return msgspec.structs.replace(
            proc,
            argv=[sub(a) for a in proc.argv],
            env={k: sub(v) for k, v in proc.env.items()},
            ports=ports,
            readiness=msgspec.structs.replace(proc.readiness, target=sub(proc.readiness.target)),
        )

    return msgspec.structs.replace(
        plan, processes=[fill(p) for p in plan.processes], standby=[fill(p) for p in plan.standby]
    )


def node_of(host: str, hosts: list[str], resolved: dict[str, str]) -> str:
    """`NODE (ADDRESS)` a host key became in the job."""
    i = hosts.index(host)
    return f"{resolved.get(f'NODE_{i}', '?')} ({resolved.get(_var('node', host), '?')})"
