"""The host tier's store and the block manager's use of it: byte bound, integrity checks,
tenant isolation, and host hits restored into fresh blocks at admission."""

from __future__ import annotations

import torch

from services.target.engine.block_manager import BlockManager
from services.target.engine.host_tier import HostEntry, HostTier, TierIdentity

BLOCK_BYTES = 64
IDENTITY = TierIdentity("model", "torch.float32", 4, BLOCK_BYTES)
KEY_A, KEY_B = "model\x00salt-a", "model\x00salt-b"


def _data(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _run_stores(bm: BlockManager) -> list[int]:
    """What ModelRunner.move_tiers does with the stores, with each block's id as its bytes' seed."""
    moves = bm.take_tier_moves()
    for block_id, h, key, _ in moves.stores:
        moves.tier.put(h, moves.tier.entry(key, _data(block_id)))
    return [b for b, _, _, _ in moves.stores]


def test_the_byte_bound_holds_and_the_oldest_entries_go_first():
    tier = HostTier(5 * BLOCK_BYTES + 10, IDENTITY)
    for h in range(12):
        assert tier.put(h, tier.entry((None, (h,), KEY_A), _data(h)))
        assert tier.stats().used_bytes <= tier.capacity_bytes
    assert tier.hashes() == [7, 8, 9, 10, 11]
    s = tier.stats()
    assert (s.entries, s.used_bytes, s.stored_blocks, s.dropped_blocks) == (5, 5 * BLOCK_BYTES, 12, 7)
    big = HostEntry.build((None, (99,), KEY_A), torch.zeros(6 * BLOCK_BYTES, dtype=torch.uint8), IDENTITY)
    assert not tier.put(99, big)  # can never fit: refused, nothing else dropped for it
    assert tier.hashes() == [7, 8, 9, 10, 11]


def test_take_serves_intact_entries_byte_equal_and_drops_bad_ones():
    tier = HostTier(1 << 20, IDENTITY)
    keys = {h: (None, (h,), KEY_A) for h in range(5)}
    for h, key in keys.items():
        tier.put(h, tier.entry(key, _data(h)))
    tier.entry_of(1).data[3] ^= 0x40  # corrupted in place after its checksum
    tier.entry_of(2).data = tier.entry_of(2).data[:-4]  # truncated
    foreign = TierIdentity("other-model", IDENTITY.kv_dtype, IDENTITY.block_size, BLOCK_BYTES)
    tier.put(3, HostEntry.build(keys[3], _data(3), foreign))  # another model's (a shared store)
    tier.put(4, HostEntry.build(keys[4], _data(4), TierIdentity("model", "torch.bfloat16", 4, BLOCK_BYTES)))
    assert tier.take(0, (None, (0,), KEY_B)) is None  # other tenant's key: not served, still held
    assert torch.equal(tier.take(0, keys[0]), _data(0))
    assert [tier.take(h, keys[h]) for h in (1, 2, 3, 4)] == [None] * 4
    s = tier.stats()
    assert (s.restored_blocks, s.rejected_blocks, s.entries, s.used_bytes) == (1, 4, 0, 0)


def _admit(bm: BlockManager, seq_id: str, tokens: list[int], key: str = KEY_A):
    return bm.admit(seq_id, bm.match_prefix(tokens, key), len(tokens), len(tokens))


def test_an_evicted_prefix_is_restored_into_fresh_blocks_and_counts_as_cached():
    bm = BlockManager(num_blocks=4, block_size=4, host_tier=HostTier(1 << 20, IDENTITY))
    prompt = list(range(13))  # 3 full blocks + 1 token
    _admit(bm, "a", prompt)
    bm.commit("a", prompt, 13, KEY_A)
    bm.release("a")  # 3 cached blocks, evictable
    _admit(bm, "b", list(range(100, 116)))  # needs all 4: evicts a's 3 cached blocks
    assert sorted(_run_stores(bm)) == [0, 1, 2]
    bm.commit("b", list(range(100, 116)), 16, KEY_A)
    bm.release("b")
    assert bm.match_prefix(prompt, KEY_B).num_tokens == 0  # another tenant: no hit in either tier
    match = bm.match_prefix(prompt, KEY_A)
    assert (match.block_ids, len(match.host_blocks), match.num_tokens) == ((), 3, 12)
    assert bm.can_admit(match, 13)
    admitted = bm.admit("c", match, 13, 13)
    assert admitted.num_tokens == 12 and admitted.host_blocks == ()
    moves = bm.take_tier_moves()
    assert [b for b, _ in moves.restores] == bm.block_table("c")[:3]
    assert [torch.equal(d, _data(s)) for (_, d), s in zip(moves.restores, [0, 1, 2])] == [True] * 3
    assert len(moves.stores) == 4  # b's 4 full blocks, evicted for c's
    assert bm.match_prefix(prompt, KEY_A).block_ids == tuple(bm.block_table("c")[:3])  # back in the pool
    assert bm.stats().prefix_hit_tokens == 12


def test_a_bad_entry_ends_the_restore_there_and_the_rest_is_computed():
    tier = HostTier(1 << 20, IDENTITY)
    bm = BlockManager(num_blocks=4, block_size=4, host_tier=tier)
    prompt = list(range(13))
    _admit(bm, "a", prompt)
    bm.commit("a", prompt, 13, KEY_A)
    bm.release("a")
    _admit(bm, "b", list(range(100, 116)))
    _run_stores(bm)
    bm.release("b")
    second = bm.match_prefix(prompt, KEY_A).host_blocks[1][0]
    tier.entry_of(second).data[0] ^= 1
    admitted = bm.admit("c", bm.match_prefix(prompt, KEY_A), 13, 13)
    assert admitted.num_tokens == 4  # the first block restored; the corrupt one and after: recompute
    assert len(bm.block_table("c")) == 4 and len(bm.take_tier_moves().restores) == 1
    assert tier.stats().rejected_blocks == 1


def test_host_hits_are_used_only_while_restoring_is_measured_cheaper_than_recomputing():
    tier = HostTier(1 << 20, IDENTITY)
    bm = BlockManager(num_blocks=4, block_size=4, host_tier=tier)
    prompt = list(range(13))
    _admit(bm, "a", prompt)
    bm.commit("a", prompt, 13, KEY_A)
    bm.release("a")
    _admit(bm, "b", list(range(100, 116)))
    _run_stores(bm)
    bm.release("b")
    assert tier.restore_pays()  # nothing measured yet
    tier.take(*bm.match_prefix(prompt, KEY_A).host_blocks[0])  # one restore, then its cost
    tier.add_time(restore_s=0.010)
    tier.observe_recompute(0.004, 100)  # 0.16 ms per block of 4: recomputing is cheaper
    assert not tier.restore_pays()
    assert bm.match_prefix(prompt, KEY_A).num_tokens == 0  # the host tier is not looked at
    for _ in range(40):
        tier.observe_recompute(10.0, 100)  # prefill got expensive (a long batch, a slow device)
    assert tier.restore_pays()
    assert len(bm.match_prefix(prompt, KEY_A).host_blocks) == 0  # block 0 was taken above: a miss
    assert tier.has(*_second_block(prompt))


def _second_block(prompt):
    from services.common.block_hash import block_hash
    first = block_hash(None, tuple(prompt[:4]), KEY_A)
    tokens = tuple(prompt[4:8])
    return block_hash(first, tokens, KEY_A), (first, tokens, KEY_A)


def test_a_block_held_by_both_tiers_is_never_registered_twice():
    """A block recomputed while its evicted copy was being stored is in the pool and the tier;
    a match that reaches it through the tier stops there, and the pool's bookkeeping stays whole."""
    tier = HostTier(1 << 20, IDENTITY)
    bm = BlockManager(num_blocks=6, block_size=4, host_tier=tier)
    prompt = list(range(13))
    _admit(bm, "a", prompt)
    bm.commit("a", prompt, 13, KEY_A)
    bm.release("a")
    _admit(bm, "b", list(range(100, 124)))
    _run_stores(bm)  # a's 3 blocks: host tier only
    bm.release("b")
    (h0, k0), (h1, k1), _ = bm.match_prefix(prompt, KEY_A).host_blocks
    _admit(bm, "c", prompt[:9])  # restores blocks 0 and 1 into the pool
    first, second = bm.block_table("c")[:2]
    tier.put(h0, tier.entry(k0, _data(0)))
    tier.put(h1, tier.entry(k1, _data(1)))  # block 1 in both tiers
    bm.forget([first])  # block 0 only in the tier
    bm.release("c")
    admitted = bm.admit("d", bm.match_prefix(prompt, KEY_A), 13, 13)
    assert admitted.num_tokens == 4  # block 0 restored; block 1 stops the restore
    assert bm.match_prefix(prompt[:9], KEY_A).block_ids[1] == second  # still the pool's block 1
    bm.release("d")
    _admit(bm, "e", list(range(200, 224)))  # evicts every cached block: no stale mapping left behind
    bm.release("e")
    assert bm.num_free == 6
