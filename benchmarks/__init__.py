"""Benchmarks: `python -m benchmarks.engine` measures every cached path beside its reference."""
