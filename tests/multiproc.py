"""The one helper multi-process tests use (it lives in the package so benchmarks and the profiler share it)."""

from megatron_2bw.testing.local_workers import free_port, run_workers  # noqa: F401
