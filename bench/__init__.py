"""Benchmarks: `make bench` (or `python -m bench.run_all`) runs them all."""
