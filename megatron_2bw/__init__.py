"""megatron_2bw: Megatron-style training with PipeDream-2BW pipeline parallelism."""

__version__ = "0.1.0"
