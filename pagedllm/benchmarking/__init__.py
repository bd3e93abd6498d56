"""Benchmarks behind `pagedllm bench`: offline throughput, datasets, reports, online latency."""
