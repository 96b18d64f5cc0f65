"""`dyngraph bench`: load a running graph (or each variant of a sweep) and report what users see.

The load generator (`loadgen`), workloads (`workload`) and statistics (`stats`) know nothing
about graphs and are what the scripts in benchmarks/ use too; `sweep` brings graphs up and down
through the supervisor that `dyngraph up` and `down` use.
"""
