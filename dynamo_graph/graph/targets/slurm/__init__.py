"""The Slurm target: a graph's launch plan as one Slurm job, each process an `srun` step.

script.py    the sbatch script and the plan it runs (`render -f slurm`)
job.py       Slurm's command line, and the job's records in the state dir
probe.py     the readiness check beside each step, run on the node
commands.py  `up --target slurm`, `status`, `down` of a graph that runs as a job
rollout.py   `up` on a running job: a change within its allocation rolls its steps, others are refused
autoscale.py the planner inside the job: autoscaled pools grow onto standby steps and shrink with drain
target.py    the target
"""
