"""Exact behaviour of the block manager: ids, reference counts, prefix hits, eviction order."""

from __future__ import annotations

import pytest

from services.target.engine.block_manager import BlockManager, OutOfBlocks, block_hash

KEY = "model\x00salt-a"


def admit(bm: BlockManager, seq_id: str, tokens: list[int], extra_key: str = KEY):
    match = bm.match_prefix(tokens, extra_key)
    bm.admit(seq_id, match, len(tokens), len(tokens))
    return match


def test_allocation_ids_ref_counts_and_release():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, "a", list(range(10)))  # 3 blocks
    admit(bm, "b", list(range(100, 105)))  # 2 blocks
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.block_table("b") == [3, 4]
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.reserve("a", 13) == [5]
    assert bm.slots("a", 11, 13) == [2 * 4 + 3, 5 * 4 + 0]
    assert bm.release("a") == 4
    assert bm.num_free == 6
    assert bm.ref_count(0) == 0


def test_an_allocation_that_cannot_be_satisfied_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    admit(bm, "a", list(range(8)))
    before = (bm.block_table("a"), bm.num_free, [bm.ref_count(i) for i in range(4)])
    assert not bm.can_reserve("a", 8 + 9)
    with pytest.raises(OutOfBlocks):
        bm.reserve("a", 8 + 9)
    match = bm.match_prefix(list(range(100, 120)), KEY)
    assert not bm.can_admit(match, 20)
    with pytest.raises(OutOfBlocks):
        bm.admit("b", match, 20, 20)
    assert (bm.block_table("a"), bm.num_free, [bm.ref_count(i) for i in range(4)]) == before
    assert not bm.has("b")


def test_prefix_hit_shares_blocks_and_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    admit(bm, "a", prompt)
    bm.commit("a", prompt, 12, KEY)
    assert bm.stats().cached_blocks == 3
    match = bm.match_prefix(prompt, KEY)
    # 12 tokens = 3 full blocks, but one token must stay uncached: 2 blocks hit.
    assert match.block_ids == (0, 1) and match.num_tokens == 8
    bm.admit("b", match, 12, 12)
    assert bm.block_table("b") == [0, 1, 3]
    assert [bm.ref_count(i) for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert bm.match_prefix(prompt + [99], KEY).num_tokens == 12


def test_different_salt_or_tokens_miss():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    admit(bm, "a", prompt)
    bm.commit("a", prompt, 9, KEY)
    assert bm.match_prefix(prompt, KEY).num_tokens == 8
    assert bm.match_prefix(prompt, "model\x00salt-b").num_tokens == 0
    assert bm.match_prefix([0, 1, 2, 3, 7, 7, 7, 7, 7], KEY).num_tokens == 4  # 2nd block differs


def test_collision_check_compares_stored_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    admit(bm, "a", prompt)
    bm.commit("a", prompt, 9, KEY)
    # Forge a collision: another token run registered under the first block's hash.
    h0 = block_hash(None, (0, 1, 2, 3), KEY)
    bm._blocks[bm._cached[h0]].key = (None, (9, 9, 9, 9), KEY)
    assert bm.match_prefix(prompt, KEY).num_tokens == 0


def test_unreferenced_cached_blocks_are_evicted_lru_tail_first_and_only_when_needed():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    admit(bm, "a", a)
    bm.commit("a", a, 5, KEY)  # blocks 0,1 cached; 2 partial
    admit(bm, "b", b)
    bm.commit("b", b, 5, KEY)  # blocks 3,4 cached; 5 partial
    bm.release("a")
    bm.release("b")
    # Released last block first: a's tail before a's head, then b's.
    assert bm.evictable_order() == [1, 0, 4, 3]
    assert bm.num_free == 6 and bm.stats().cached_blocks == 4
    bm.drain_events()
    admit(bm, "c", [50, 51, 52])  # 2 blocks: never-cached free blocks 2 and 5 first
    assert bm.block_table("c") == [2, 5]
    assert bm.stats().evictions == 0
    admit(bm, "d", [60, 61, 62])  # now evicts LRU: block 1 (a's tail), then block 0
    assert bm.block_table("d") == [1, 0]
    assert bm.stats().evictions == 2
    assert [e.kind for e in bm.drain_events()] == ["removed", "removed"]
    assert bm.drain_events() == []  # drained once
    assert bm.match_prefix(a, KEY).num_tokens == 0
    assert bm.match_prefix(b, KEY).num_tokens == 4  # b's blocks survive


def test_reviving_an_evictable_block_removes_it_from_the_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    p = [1, 2, 3]
    admit(bm, "a", p)
    bm.commit("a", p, 3, KEY)
    bm.release("a")
    assert bm.evictable_order() == [0]
    admit(bm, "b", p)
    assert bm.block_table("b")[0] == 0 and bm.evictable_order() == []
    assert bm.ref_count(0) == 1


def test_stored_events_carry_chained_hashes_and_a_scope():
    bm = BlockManager(num_blocks=4, block_size=2)
    p = [1, 2, 3, 4, 5]
    admit(bm, "a", p)
    bm.commit("a", p, 5, KEY)
    first, second = bm.drain_events()
    assert first.kind == second.kind == "stored"
    assert first.parent_hash is None and second.parent_hash == first.block_hash
    assert first.block_hash == block_hash(None, (1, 2), KEY)
    assert first.scope == second.scope and "salt" not in first.scope


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    p = [1, 2, 3, 4, 5]
    admit(bm, "a", p)
    bm.commit("a", p, 5, KEY)
    assert bm.match_prefix(p, KEY).num_tokens == 0 and bm.stats().cached_blocks == 0
