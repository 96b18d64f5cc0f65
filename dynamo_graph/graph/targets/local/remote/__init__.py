"""Processes on other hosts: the supervisor's ssh launcher (ssh.py) and the agent it runs there
(agent.py; its `run` and `attach` in agent_run.py, its hub-model check in hub_probe.py). The
agent also answers preflight's probe of this host and the Slurm job's requests for free ports.
Nothing here imports the graph loader: the agent starts in a remote host's own python."""
