"""Helpers for checking the engine, shared by the test suite and the benchmarks: transformers
references on the same weights (hf_reference.py) and servers on free loopback ports (servers.py)."""
