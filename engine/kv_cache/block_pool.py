"""The block pool: fixed-size KV blocks, their reference counts, the LRU free list and the prefix map.

Invariants (checked by the property tests):
- a block is in the free list exactly when its `ref_cnt` is 0;
- a block is in the prefix map only while it holds the KV of the tokens it is keyed by; it
  may sit in the free list meanwhile (cached but unreferenced) and is evicted from the map
  when it is handed out again;
- the free list is in eviction order: blocks that hold no cached prefix go to the front
  (they are worth nothing), freed cached blocks to the back (least recently used first).
No torch: this only hands out block ids; the model runner owns the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix map: the chain hash, its parent's hash
    # and the block's tokens (compared on lookup, so a hash collision can never alias two prefixes).
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Owns every block; hands out, shares, frees and caches them."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Take `num_blocks` blocks off the front of the free list, or None if there are too few."""
        if num_blocks > len(self._free):
            return None
        taken: list[KVBlock] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add a reference to blocks found in the prefix cache (taking free ones off the free list)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (callers pass tail blocks first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def cache(self, block: KVBlock, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        """Register a full block under its chain hash; the first holder of a given prefix wins."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only allowed when no block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            self._uncache(block)
        return True

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = ()

    def check_invariants(self) -> None:
        """Raise AssertionError-free RuntimeError if the bookkeeping is inconsistent (tests and debug)."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            if in_free != (block.ref_cnt == 0) or block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id}: ref_cnt={block.ref_cnt}, in free list={in_free}")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"prefix map entry {block_hash} points at block {block.block_id} with another hash")
