"""Trajectories and how they become training micro-batches."""
