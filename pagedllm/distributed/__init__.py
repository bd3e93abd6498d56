"""Tensor parallelism: weight slices per rank, starting and watching ranks, the worker loop."""
