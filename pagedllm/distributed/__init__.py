"""Tensor parallelism across processes: starting and watching ranks, and the worker loop."""
