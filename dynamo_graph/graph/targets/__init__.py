"""Launch targets: where a graph's plan runs, each behind one interface (base.py: `Target`).

    base.py       the `Target` interface: up, status, logs, down, and the formats it renders
    dispatch.py   which target a command goes to (`--target`, the state dir, `--format`)
    local/        this machine and ssh hosts: the supervisor and its client commands
    slurm/        one Slurm job, each process an `srun` step
    k8s/          render only: plain Kubernetes manifests, a Dynamo DynamoGraphDeployment, and
                  `dyngraph import` of a DGD

Targets import the graph core (graph/: schema, load, validate, compile, plan, render), never
the other way round. A target may build on the local one (Slurm reuses its state dir, status
table and logs). This file imports nothing, so the agent and the supervisor load only what they
run; dispatch.py, which imports every target, is for the CLI.
"""
