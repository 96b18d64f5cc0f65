"""Graphs: the declarative core, and the targets that launch what it compiles.

The core turns a graph file into a launch plan and knows no target:
    schema.py    the graph's shape (pydantic), the one place to read the YAML's keys
    load.py      the file with Hydra-style composition and overrides, lines kept for errors
    validate.py  every problem at once, each with file:line and key path
    compile.py   graph -> plan: one `dyngraph run` command line per replica, ports, env
    plan.py      the plan (msgspec, so the supervisor starts without pydantic)
    build.py     load -> validate -> compile, the one entry point of the commands
    render.py    the graph's own `render` formats (yaml, json, mermaid) and secret redaction
    errors.py, paths.py (the state dir's path), metric_expr.py (`tests:` metric expressions)

targets/ launches a plan: on this machine and ssh hosts, as a Slurm job, or rendered for
Kubernetes (targets/__init__.py maps it). Targets import the core, never the other way round.
"""
