"""Benchmarks: ``python -m benchmarks.act`` (schedulers on a simulated agentic-RL workload) and others."""
