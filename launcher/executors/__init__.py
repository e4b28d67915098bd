"""Executors: local processes or Slurm jobs, one StagePlan per stage."""
