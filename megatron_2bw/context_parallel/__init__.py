"""Context parallelism: each sequence sharded over ``c`` ranks that exchange attention's keys and values."""

from .group import CPGroup, shard_batch

__all__ = ["CPGroup", "shard_batch"]
