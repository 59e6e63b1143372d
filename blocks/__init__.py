"""Prefect blocks: the inference endpoint generate talks to, and the GPU host the gpu pool runs
on. `draftsmith prefect setup` registers both types and saves the instances."""
