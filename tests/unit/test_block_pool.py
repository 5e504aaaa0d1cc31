"""Block pool and KV cache manager: exact eviction order, hit counts, integrity."""
from __future__ import annotations

import random

import pytest

from appliance.engine.block_pool import NULL_BLOCK, BlockPool, hash_block
from appliance.engine.kv_cache_manager import KVCacheManager
from appliance.engine.request import Request
from appliance.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4), (), 4)


def test_allocate_takes_lru_head_and_free_appends_in_given_order():
    pool = BlockPool(6, 4)
    a = [b.block_id for b in pool.allocate(3)]
    assert a == [0, 1, 2]
    pool.free([2, 1, 0])  # a request frees its blocks tail first
    assert [b.block_id for b in pool.free_queue] == [3, 4, 5, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(4)] == [3, 4, 5, 2]
    pool.check([[3, 4, 5, 2]])


def test_free_queue_remove_middle_is_consistent():
    pool = BlockPool(5, 4)
    blocks = pool.allocate(5)
    pool.free([b.block_id for b in blocks])
    pool.touch([pool.blocks[2]])  # revive a cached free block from the middle of the queue
    assert [b.block_id for b in pool.free_queue] == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4
    pool.check([[2]])


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    kv = KVCacheManager(8, 4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a = req("a", tokens)
    assert kv.allocate_slots(a, 10)
    assert len(a.block_ids) == 3 and len(a.block_hashes) == 2
    b = req("b", tokens + [99])
    blocks, hashes = kv.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == a.block_ids[:2]
    assert hashes == a.block_hashes
    assert kv.pool.num_queries == 11 and kv.pool.num_hits == 8
    assert kv.allocate_slots(b, 3, blocks, hashes)
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_computed_tokens == 8
    kv.pool.check([a.block_ids, b.block_ids])
    assert kv.pool.blocks[a.block_ids[0]].ref_cnt == 2


def test_last_token_is_never_a_hit():
    kv = KVCacheManager(8, 4)
    a = req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    # Same 8 tokens: both blocks cached, but only the first may hit (token 7 must be computed).
    blocks, _ = kv.get_computed_blocks(req("b", list(range(8))))
    assert [b.block_id for b in blocks] == a.block_ids[:1]


def test_hash_chains_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])
    kv = KVCacheManager(8, 2)
    a = req("a", [5, 6, 1, 2, 9])
    kv.allocate_slots(a, 5)
    # Block [1, 2] after a different first block must not hit.
    blocks, _ = kv.get_computed_blocks(req("b", [7, 7, 1, 2, 9]))
    assert blocks == []


def test_hash_collision_is_rejected_by_token_check():
    pool = BlockPool(4, 2)
    b = pool.allocate(1)[0]
    h = hash_block(None, [1, 2])
    pool.cache_block(b.block_id, h, None, [1, 2])
    # Simulate a colliding entry: same hash key, different stored tokens.
    pool.blocks[b.block_id].token_ids = (3, 4)
    assert pool.lookup(None, [1, 2])[1] is None


def test_eviction_order_and_cached_free_blocks():
    kv = KVCacheManager(4, 2)
    a = req("a", [1, 2, 3, 4, 5])  # blocks [1,2] [3,4] [5]
    assert kv.allocate_slots(a, 5)
    ids = list(a.block_ids)
    kv.free(a)
    # freed tail first: queue = [3] then ids reversed
    assert [b.block_id for b in kv.pool.free_queue] == [3, ids[2], ids[1], ids[0]]
    # a fresh request needing 2 blocks evicts block 3 (never used) and then the tail block of a
    c = req("c", [9, 9, 9])
    assert kv.allocate_slots(c, 3)
    assert c.block_ids == [3, ids[2]]
    assert kv.pool.num_evictions == 0  # neither held a cached full block
    # a's first two full blocks are still cached and hit
    blocks, _ = kv.get_computed_blocks(req("a2", [1, 2, 3, 4, 5]))
    assert [b.block_id for b in blocks] == ids[:2]
    d = req("d", [8, 8, 8, 8])  # needs 2 blocks: takes ids[1] then ids[0], evicting both
    assert kv.allocate_slots(d, 4)
    assert d.block_ids == [ids[1], ids[0]]
    assert kv.pool.num_evictions == 2
    assert kv.get_computed_blocks(req("a3", [1, 2, 3, 4, 5]))[0] == []


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(3, 2)
    a = req("a", [1] * 5)
    assert kv.allocate_slots(a, 5)
    b = req("b", [2] * 3)
    assert not kv.allocate_slots(b, 3)
    assert b.block_ids == [] and kv.pool.num_free_blocks == 0
    kv.pool.check([a.block_ids])


def test_blocks_out_of_every_window_are_released_and_stay_cached():
    kv = KVCacheManager(10, 4, sliding_window=6)
    tokens = list(range(20))
    a = req("a", tokens)
    assert kv.allocate_slots(a, 20)
    a.num_computed_tokens = 18
    assert a.block_ids == [0, 1, 2, 3, 4]
    # the next query (position 18) sees 13..18: blocks 0-2 (positions 0..11) are done with
    assert kv.free_out_of_window(a) == 3
    assert a.block_ids == [NULL_BLOCK] * 3 + [3, 4]
    assert [b.block_id for b in kv.pool.free_queue] == [5, 6, 7, 8, 9, 2, 1, 0]  # latest first
    kv.pool.check([a.block_ids])
    assert kv.free_out_of_window(a) == 0  # nothing new
    a.num_computed_tokens = 20
    assert kv.free_out_of_window(a) == 0  # 15..20: block 3 (12..15) still visible
    a.num_computed_tokens = 21
    assert kv.free_out_of_window(a) == 1 and a.block_ids == [NULL_BLOCK] * 4 + [4]
    kv.pool.check([a.block_ids])
    # released blocks keep their hashes: the same prompt hits all four full blocks
    blocks, _ = kv.get_computed_blocks(req("b", tokens))
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    kv.free(a)  # only block 4 is still held
    assert kv.pool.num_free_blocks == 10
    kv.pool.check([])


def test_no_release_without_a_window_on_every_layer():
    kv = KVCacheManager(10, 4, sliding_window=None)
    a = req("a", list(range(20)))
    assert kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    assert kv.free_out_of_window(a) == 0 and a.block_ids == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="sliding_window must be >= 1 or None, got 0"):
        KVCacheManager(10, 4, sliding_window=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", range(5))
def test_randomized_workload_keeps_integrity(seed, window):
    rng = random.Random(seed)
    kv = KVCacheManager(24, 4, sliding_window=window)
    live = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    for step in range(300):
        if live and rng.random() < 0.4:
            rid = rng.choice(list(live))
            kv.free(live.pop(rid))
        else:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            r = req(f"r{step}", toks)
            blocks, hashes = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, len(toks) - len(blocks) * 4, blocks, hashes):
                live[r.request_id] = r
                # decode a few tokens one at a time
                for _ in range(rng.randrange(4)):
                    r.append_token(rng.randrange(50))
                    r.num_computed_tokens = r.num_tokens - 1
                    kv.free_out_of_window(r)
                    if not kv.allocate_slots(r, 1):
                        break
                    r.num_computed_tokens = r.num_tokens
        kv.pool.check(r.block_ids for r in live.values())
