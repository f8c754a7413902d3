"""The router's global prefix index: which prefill worker holds which KV blocks.

`InMemoryPrefixIndex` is the embedded default; `RedisPrefixIndex` is shared by router
replicas. Importing this package does not import redis: the Redis backend loads on first use.
"""
from __future__ import annotations

from .base import DEFAULT_MAX_BLOCKS, IndexStats, PrefixIndex, PrefixIndexConfig
from .memory import InMemoryPrefixIndex


def build_prefix_index(config: PrefixIndexConfig) -> PrefixIndex:
    if config.backend == "memory":
        return InMemoryPrefixIndex(max_blocks=config.max_blocks, ttl_s=config.ttl_s)
    from .redis_backend import RedisPrefixIndex

    return RedisPrefixIndex.from_url(config.redis_url, password=config.redis_password or None,
                                     namespace=config.namespace, max_blocks=config.max_blocks, ttl_s=config.ttl_s)


def __getattr__(name: str):
    if name == "RedisPrefixIndex":
        from .redis_backend import RedisPrefixIndex

        return RedisPrefixIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "IndexStats",
    "InMemoryPrefixIndex",
    "PrefixIndex",
    "PrefixIndexConfig",
    "RedisPrefixIndex",
    "build_prefix_index",
]
