"""Unit tests of the KV block pool and the KV cache manager (no model, no torch).

They pin down the bookkeeping the scheduler relies on: the free list's eviction order
(worthless blocks first, then cached ones least-recently-used first), reference counts of
shared prefix blocks, refusing a double free, what the prefix cache may return (full blocks
only, chain-hashed, never the last token), the token-based hit counters, and that a failed
`allocate_slots` leaves everything exactly as it was.
"""

from __future__ import annotations

import pytest

from tidepool.engine.kv_cache import BlockPool, KVCacheManager
from tidepool.engine.request import Request
from tidepool.engine.sampling_params import SamplingParams


def _request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def _fill(manager: KVCacheManager, request: Request) -> None:
    """Allocate and 'compute' a whole request, as a scheduler step would, using any prefix hits."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens


def _free_order(pool: BlockPool) -> list[int]:
    """The order in which the pool would hand out its free blocks, read by allocating all of them."""
    blocks = pool.allocate(pool.num_free_blocks)
    assert blocks is not None
    return [block.block_id for block in blocks]


def _snapshot(manager: KVCacheManager) -> tuple[object, ...]:
    pool = manager.pool
    return (
        pool.num_free_blocks,
        list(pool._free),
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool._cached),
        {rid: [b.block_id for b in blocks] for rid, blocks in manager._blocks.items()},
        dict(manager._num_registered),
    )


# ---- block pool -------------------------------------------------------------------------------
def test_allocate_takes_blocks_in_free_list_order_and_returns_none_when_short() -> None:
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert first is not None
    assert [b.block_id for b in first] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in first)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_uncached_freed_blocks_are_evicted_before_cached_ones() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.cache(blocks[0], 100, None, (1, 2))
    pool.cache(blocks[1], 101, 100, (3, 4))
    # Tail first, as the manager frees: 3 and 2 hold nothing cached, 1 and 0 hold a prefix.
    pool.free([blocks[3], blocks[2], blocks[1], blocks[0]])
    pool.check_invariants()
    # Worthless blocks come first; of the cached ones the suffix (freed first) goes before the prefix.
    assert _free_order(pool) == [2, 3, 1, 0]


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    for i, block in enumerate(blocks):
        pool.cache(block, 200 + i, None, (i,))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    # Reusing block 1 from the cache (a prefix hit) makes it the most recently used again.
    assert pool.lookup(201, None, (1,)) is blocks[1]
    pool.touch([blocks[1]])
    pool.free([blocks[1]])
    pool.check_invariants()
    taken = pool.allocate(1)
    assert taken is not None and taken[0] is blocks[0]
    # Handing a cached block out again evicts it from the prefix map; the others stay.
    assert pool.lookup(200, None, (0,)) is None
    assert pool.lookup(202, None, (2,)) is blocks[2]
    assert _free_order(pool) == [2, 1]


def test_double_free_raises_and_does_not_corrupt_the_pool() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)
    pool.check_invariants()
    assert pool.num_free_blocks == 2
    assert blocks[0].ref_cnt == 0


def test_usage_counts_referenced_blocks_only() -> None:
    pool = BlockPool(4)
    assert pool.usage == 0.0
    blocks = pool.allocate(3)
    assert blocks is not None
    assert pool.usage == pytest.approx(0.75)
    pool.cache(blocks[0], 7, None, (7,))
    pool.free(blocks)
    assert pool.usage == 0.0  # a cached but unreferenced block is reclaimable, so it counts as free


def test_cache_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.cache(blocks[0], 5, None, (1,))
    assert pool.lookup(5, None, (1,)) is None
    assert blocks[0].block_hash is None


def test_lookup_compares_tokens_and_parent_not_only_the_hash() -> None:
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.cache(blocks[0], 42, 7, (1, 2))
    assert pool.lookup(42, 7, (1, 2)) is blocks[0]
    assert pool.lookup(42, 7, (1, 3)) is None  # a colliding hash must not alias another block's tokens
    assert pool.lookup(42, 8, (1, 2)) is None


def test_reset_prefix_cache_only_when_nothing_is_referenced() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.cache(blocks[0], 9, None, (1,))
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(9, None, (1,)) is blocks[0]
    pool.free(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(9, None, (1,)) is None
    pool.check_invariants()


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


# ---- KV cache manager -------------------------------------------------------------------------
def test_shared_prefix_blocks_are_reference_counted() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    _fill(manager, first)
    second = _request("b", [*range(8), 50, 51, 52])
    _fill(manager, second)
    shared = manager.block_ids("a")[:2]
    assert manager.block_ids("b")[:2] == shared
    assert manager.block_ids("b")[2] != manager.block_ids("a")[2]
    assert [manager.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert manager.num_free_blocks == 8 - 4

    manager.free(first)
    assert [manager.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert manager.num_free_blocks == 8 - 3  # only a's private tail block came back
    manager.pool.check_invariants()
    manager.free(second)
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)
    assert manager.num_free_blocks == 8
    manager.pool.check_invariants()


def test_freeing_an_unknown_or_already_freed_request_is_a_no_op() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = _request("a", [1, 2, 3, 4, 5])
    _fill(manager, request)
    manager.free(request)
    manager.free(request)  # the manager forgets the request's blocks, so it cannot free them twice
    assert manager.num_free_blocks == 4
    manager.pool.check_invariants()


@pytest.mark.parametrize(
    ("num_tokens", "expected_hit_tokens"),
    [
        (4, 0),  # one full block, but its last token must be computed: no hit
        (5, 4),
        (8, 4),  # two full blocks: the second holds the last token, so only the first is reused
        (9, 8),
        (12, 8),  # the third block was never full in the cached request, so it was never cached
        (13, 8),
    ],
)
def test_prefix_hits_are_full_blocks_and_never_the_last_token(num_tokens: int, expected_hit_tokens: int) -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    _fill(manager, _request("cached", list(range(10))))  # full blocks [0..3] and [4..7] get cached
    probe = _request("probe", [*range(10), 90, 91, 92][:num_tokens])
    hits, num_hit_tokens = manager.get_computed_blocks(probe)
    assert num_hit_tokens == expected_hit_tokens
    assert len(hits) * 4 == expected_hit_tokens
    assert num_hit_tokens <= probe.num_tokens - 1


def test_identical_prompt_reuses_all_but_the_block_holding_the_last_token() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    _fill(manager, _request("a", list(range(12))))
    again = _request("b", list(range(12)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 8
    assert [b.block_id for b in hits] == manager.block_ids("a")[:2]


def test_chain_hashing_same_block_after_a_different_prefix_does_not_hit() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    p1, p2, q = [1, 1, 1, 1], [2, 2, 2, 2], [7, 8, 9, 10]
    _fill(manager, _request("a", [*p1, *q, 0]))  # caches p1, then q after p1
    _fill(manager, _request("d", [*p2, 3, 3, 3, 3, 0]))  # caches p2, then something else after p2
    probe = _request("b", [*p2, *q, 0])
    hits, num_hit_tokens = manager.get_computed_blocks(probe)
    # p2 hits; q's tokens are cached, but only after p1, so they are a different chain.
    assert num_hit_tokens == 4
    assert [b.block_id for b in hits] == manager.block_ids("d")[:1]


def test_hit_counters_are_in_tokens() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    _fill(manager, _request("a", list(range(10))))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)
    _fill(manager, _request("b", [*range(9), 77, 78]))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (21, 8)
    _fill(manager, _request("c", [5, 5, 5, 5, 5]))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (26, 8)


def test_lookup_counted_once_when_the_allocation_must_wait() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    _fill(manager, _request("a", list(range(12))))  # 3 of 4 blocks held
    waiting = _request("b", [*range(8), 50, 51, 52, 53, 54, 55])
    for _ in range(3):  # the head of the queue retries every step while memory is short
        hits, num_hit = manager.get_computed_blocks(waiting)
        assert num_hit == 8
        assert not manager.allocate_slots(waiting, waiting.num_tokens - num_hit, hits)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (12, 0)
    manager.free(_request("a", list(range(12))))
    hits, num_hit = manager.get_computed_blocks(waiting)
    assert manager.allocate_slots(waiting, waiting.num_tokens - num_hit, hits)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (26, 8)


def test_prefix_caching_off_never_hits_or_counts() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    _fill(manager, _request("a", list(range(10))))
    hits, num_hit_tokens = manager.get_computed_blocks(_request("b", list(range(10))))
    assert (hits, num_hit_tokens) == ([], 0)
    assert manager.prefix_cache_queries == 0
    assert all(block.block_hash is None for block in manager.pool.blocks)


def test_freed_prefix_survives_in_cache_until_evicted() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    first = _request("a", list(range(9)))
    _fill(manager, first)
    prefix_ids = manager.block_ids("a")[:2]
    manager.free(first)
    assert manager.usage == 0.0
    again = _request("b", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 8 and [b.block_id for b in hits] == prefix_ids
    assert manager.allocate_slots(again, 1, hits)
    assert [manager.pool.blocks[i].ref_cnt for i in prefix_ids] == [1, 1]
    manager.pool.check_invariants()


def test_decode_growth_allocates_a_block_only_at_block_boundaries() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = _request("a", [1, 2, 3])
    assert manager.allocate_slots(request, 3)
    request.num_computed_tokens = 3
    assert len(manager.block_ids("a")) == 1
    request.output_token_ids.append(4)
    assert manager.allocate_slots(request, 1)  # token 4 fills the first block
    request.num_computed_tokens = 4
    assert len(manager.block_ids("a")) == 1
    request.output_token_ids.append(5)
    assert manager.allocate_slots(request, 1)
    assert len(manager.block_ids("a")) == 2
    assert manager.num_free_blocks == 2


def test_failed_allocate_slots_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=4)
    cached = _request("cached", list(range(9)))
    _fill(manager, cached)  # 3 blocks, the first two cached
    manager.free(cached)
    holder = _request("holder", [50, 51, 52, 53, 54])
    _fill(manager, holder)  # takes the two worthless free blocks first, leaving the two cached ones free
    assert manager.num_free_blocks == 3
    # A request hitting both cached (free) blocks and needing 4 more blocks: only 1 is left after the hits.
    big = _request("big", [*range(8), *range(100, 116)])
    hits, num_hit_tokens = manager.get_computed_blocks(big)
    assert num_hit_tokens == 8
    before = _snapshot(manager)
    assert manager.allocate_slots(big, big.num_tokens - num_hit_tokens, hits) is False
    assert _snapshot(manager) == before
    assert manager.block_ids("big") == []
    manager.pool.check_invariants()

    # A running request that cannot grow keeps exactly what it had.
    holder.output_token_ids.extend(range(60, 76))
    before = _snapshot(manager)
    assert manager.allocate_slots(holder, 16) is False
    assert _snapshot(manager) == before


def test_usage_follows_allocation_and_free() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = _request("a", list(range(10)))
    _fill(manager, request)
    assert manager.usage == pytest.approx(3 / 8)
    manager.free(request)
    assert manager.usage == 0.0
