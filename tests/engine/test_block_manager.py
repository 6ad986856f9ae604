"""Block manager: exact block ids, reference counts, prefix cache and LRU eviction."""

from __future__ import annotations

import pytest

from services.engine.block_hash import ROOT_HASH, hash_block, hash_blocks
from services.engine.block_manager import BlockManager


@pytest.fixture
def bm():
    events: list[tuple[str, bytes]] = []
    m = BlockManager(
        6,
        4,
        on_cached=lambda h: events.append(("cached", h)),
        on_evicted=lambda h: events.append(("evicted", h)),
    )
    m.events = events  # type: ignore[attr-defined]
    yield m
    m.check_integrity()


def test_allocate_free_exact_ids(bm):
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []  # still fits in 2 blocks
    assert bm.allocate("a", 9) == [2]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("b", 13) is None  # needs 4, only 3 free: nothing changes
    assert bm.num_free_blocks == 3 and not bm.has("b")
    bm.free("a")
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0


def test_prefix_sharing_refcounts_and_eviction_order(bm):
    toks = list(range(12))
    hashes = hash_blocks(toks, 4)
    assert bm.allocate("a", 12) == [0, 1, 2]
    bm.cache_blocks("a", hashes)
    assert [e[0] for e in bm.events] == ["cached"] * 3
    assert bm.lookup_prefix(hashes) == [0, 1, 2]
    assert bm.lookup_prefix([hashes[0], b"?" * 16, hashes[2]]) == [0]  # stops at first miss
    # b shares the first two blocks while a still holds them
    assert bm.allocate("b", 10, [0, 1]) == [3]
    assert bm._blocks[0].ref_count == 2 and bm._blocks[3].ref_count == 1
    bm.free("a")
    assert bm._blocks[0].ref_count == 1 and bm._blocks[2].ref_count == 0
    bm.free("b")
    # evictable order: unhashed block 3 first, then a's tail before its head (LRU)
    assert list(bm._free) == [3, 4, 5, 2, 1, 0]
    assert bm.num_cached_blocks == 3
    # taking every block evicts all cached ones, tail first
    assert sorted(bm.allocate("c", 24)) == list(range(6))
    evicted = [h for kind, h in bm.events if kind == "evicted"]
    assert evicted == [hashes[2], hashes[1], hashes[0]]
    assert bm.lookup_prefix(hashes) == []
    bm.free("c")


def test_reviving_a_cached_block_takes_it_out_of_the_free_queue(bm):
    hashes = hash_blocks(list(range(8)), 4)
    bm.allocate("a", 8)
    bm.cache_blocks("a", hashes)
    bm.free("a")
    assert bm.num_free_blocks == 6
    # 4 more blocks needed + 2 revived = exactly the pool
    assert bm.allocate("b", 24, bm.lookup_prefix(hashes)) is not None
    assert bm.num_free_blocks == 0
    bm.free("b")


def test_duplicate_prefix_computed_twice_stays_unhashed(bm):
    hashes = hash_blocks(list(range(4)), 4)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.cache_blocks("a", hashes)
    bm.cache_blocks("b", hashes)
    assert bm.num_cached_blocks == 1
    bm.free("a")
    bm.free("b")


def test_prefix_caching_disabled():
    m = BlockManager(4, 2, enable_prefix_caching=False)
    m.allocate("a", 4)
    m.cache_blocks("a", hash_blocks([1, 2, 3, 4], 2))
    assert m.num_cached_blocks == 0 and m.lookup_prefix(hash_blocks([1, 2, 3, 4], 2)) == []
    m.free("a")
    m.check_integrity()


def test_block_hash_chain():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3 and all(len(h) == 16 for h in a)
    assert a == hash_blocks([1, 2, 3, 4, 5, 6], 2)
    assert hash_blocks([9, 2, 3, 4], 2)[1] != a[1]  # a block's hash covers its parent
    assert a[1] == hash_block(a[0], [3, 4])
    assert hash_block(None, [1, 2]) == hash_block(ROOT_HASH, [1, 2])
    # golden value: the encoding must not drift (the Redis index and other processes rely on it)
    assert hash_block(None, [1, 2, 3]).hex() == GOLDEN


# sha256(sha256(b"pdserve/block-hash/v1")[:16] + b"\x01\0\0\0\x02\0\0\0\x03\0\0\0")[:16]
GOLDEN = "9360c77eeb242ab04ce65c77ccef8bb9"
