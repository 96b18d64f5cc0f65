"""The Slurm target: a graph's launch plan as one Slurm job, each process an `srun` step."""
