"""Paged KV cache bookkeeping: the block pool and the manager the scheduler talks to (no torch)."""

from .block_pool import BlockPool, KVBlock
from .manager import KVCacheManager

__all__ = ["BlockPool", "KVBlock", "KVCacheManager"]
