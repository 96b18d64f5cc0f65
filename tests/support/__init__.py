"""What the tests share, so that no test module imports another (tests/unit/test_suite_layout.py):

- processes: `dyngraph` child processes (ServerProcess, WorkerProcess, run_cli), ports, pids;
- services: etcd and nats-server; ssh_hosts: sshd in network namespaces; slurm_cluster: a
  Slurm cluster; kube_schemas: the Kubernetes and DGD schemas, made strict;
- waiting: `wait_for` / `wait_for_async`, the condition waits used instead of fixed sleeps;
- metrics: a frontend's /metrics; routing: its /health instances and who served a request;
- local_graph, mocker_cluster, disagg_cluster: graphs and clusters of real processes;
- streaming, http_streams, priority_load, chaos: clients and loads the system tests drive;
- engine_requests, mocker_steps, graph_problems: helpers of the engine, mocker and graph tests;
- scripts/: programs the tests start as workers or load as engine files.
"""
