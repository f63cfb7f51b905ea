"""Helpers for running the package on several local processes (tests, benchmarks, the profiler)."""
