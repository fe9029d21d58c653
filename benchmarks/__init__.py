"""Benchmarks (run as `python -m benchmarks.NAME`); each prints a table of ratios against its peer."""
