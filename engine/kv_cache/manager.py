"""KV cache manager: the scheduler's only view of KV memory.

It hands out opaque per-request block lists, returns `None` when memory is short (the
scheduler then preempts or waits), finds prompt prefixes already in the cache, and
registers blocks in the prefix cache as soon as they are scheduled to be filled (the
forward pass writes every new token's KV before any attention reads it, so a request
scheduled in the same step may already share them).

Prefix caching hashes full blocks as a chain: hash(parent hash, block tokens). At most
`num_tokens - 1` tokens are ever taken from the cache, so the last prompt token is always
computed and its logits exist. A request with a LoRA adapter starts its chain from its adapter's load id
(`_root`) instead of None, so no KV is ever shared across adapters (or with the base model), nor with an
earlier load of the same adapter name. Counters `prefix_cache_queries`/`prefix_cache_hits` are in
tokens, as vLLM reports them, and move only when a lookup's allocation succeeds: a request
that waits at the head of the queue for several steps is counted once, not once per try.
"""

from __future__ import annotations

from ..request import Request
from .block_pool import BlockPool, KVBlock


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}  # chain hashes of the request's full blocks, computed lazily
        self._num_registered: dict[str, int] = {}  # how many leading blocks were offered to the prefix map
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, as (blocks, number of tokens)."""
        if not self.enable_prefix_caching:
            return [], 0
        num_full = (request.num_tokens - 1) // self.block_size
        hashes = self._chain_hashes(request, num_full)
        hits: list[KVBlock] = []
        parent = _root(request)
        for index in range(num_full):
            start = index * self.block_size
            tokens = tuple(request.token_ids_slice(start, start + self.block_size))
            block = self.pool.lookup(hashes[index], parent, tokens)
            if block is None:
                break
            hits.append(block)
            parent = hashes[index]
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the given cache hits).

        Pass `new_computed_blocks` (possibly empty) right after `get_computed_blocks`, so the
        lookup is counted. Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        held = self._blocks.setdefault(request.request_id, [])
        hits = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(held) - len(hits)
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            if not held:
                del self._blocks[request.request_id]
            return False
        if new_computed_blocks is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) * self.block_size
        self.pool.touch(hits)
        held.extend(hits)
        if num_needed > 0:
            fresh = self.pool.allocate(num_needed)
            if fresh is None:  # unreachable given the check above; kept so bookkeeping can never go half-done
                raise RuntimeError("block pool ran out after a successful capacity check")
            held.extend(fresh)
        if self.enable_prefix_caching:
            # Capped at the request's own tokens: slots past them hold speculative proposals, which
            # may be rejected, so a block is registered only once every token in it is real.
            self._register_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (rejected speculative slots), tail first.

        Those blocks were never registered in the prefix map (registration stops at the request's
        real tokens), so they go back as worthless blocks, first in line for reuse.
        """
        blocks = self._blocks.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free(list(reversed(tail)))

    def free(self, request: Request, keep_hashes: bool = False) -> None:
        """Release all of a request's blocks (tail first, so its prefix outlives its suffix in the LRU)."""
        blocks = self._blocks.pop(request.request_id, [])
        self.pool.free(list(reversed(blocks)))
        self._num_registered.pop(request.request_id, None)
        if not keep_hashes:
            self._hashes.pop(request.request_id, None)

    def discard(self, request: Request) -> None:
        """Free a request's blocks whose KV was never written, dropping their prefix-cache entries first."""
        for block in self._blocks.get(request.request_id, []):
            if block.ref_cnt == 1:  # only this request's own blocks; shared prefix hits hold valid KV
                self.pool._uncache(block)
        self.free(request)

    def _chain_hashes(self, request: Request, num_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(request.request_id, [])
        parent = hashes[-1] if hashes else _root(request)
        for index in range(len(hashes), num_blocks):
            start = index * self.block_size
            parent = hash((parent, tuple(request.token_ids_slice(start, start + self.block_size))))
            hashes.append(parent)
        return hashes

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        first = self._num_registered.get(request.request_id, 0)
        if num_full <= first:
            return
        hashes = self._chain_hashes(request, num_full)
        blocks = self._blocks[request.request_id]
        for index in range(first, num_full):
            start = index * self.block_size
            parent = hashes[index - 1] if index else _root(request)
            tokens = tuple(request.token_ids_slice(start, start + self.block_size))
            self.pool.cache(blocks[index], hashes[index], parent, tokens)
        self._num_registered[request.request_id] = num_full


def _root(request: Request) -> int | None:
    """The parent hash of a request's first block: None for the base model, else its adapter load's own."""
    return None if request.lora_id is None else hash(("lora", request.lora_id))
