"""Features of cached prefix blocks (services/target/speculation/prefix_features.py), the draft
call's feature budget (features.fit_features) and the scheduler's cut of a prefix match for
sequences that may reuse only part of it (PrefixMatch.first, Scheduler.prefix_limit).
Serving through real servers: tests/target/test_eagle_serving.py."""

from __future__ import annotations

import torch

from services.common.feature_rows import BYTES_PER_VALUE
from services.common.sampling_params import SamplingConfig
from services.target.engine.block_manager import BlockManager
from services.target.engine.scheduler import Scheduler
from services.target.engine.sequence import Sequence
from services.target.speculation.features import fit_features
from services.target.speculation.prefix_features import PrefixFeatures

HIDDEN = 8


def rows(start: int, n: int) -> torch.Tensor:
    """[n, HIDDEN]: position p's row is all p (exact in bf16 for p < 256)."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, HIDDEN).clone()


def test_full_blocks_are_kept_under_their_hashes_once_hashed():
    store = PrefixFeatures(block_size=4, capacity_bytes=1 << 20)
    store.collect("s", 0, rows(0, 6))  # a prefill chunk: block 0 and half of block 1
    store.seal("s", [])  # not yet hashed (the scheduler commits after the step)
    assert len(store) == 0
    store.seal("s", [10])
    assert len(store) == 1 and store.held([10, 11]) == 1
    store.collect("s", 6, rows(6, 1))
    store.collect("s", 7, rows(7, 3))  # decode rows complete block 1
    store.seal("s", [10, 11])
    assert store.held([10, 11, 12]) == 2
    got = store.prefix([10, 11])
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), rows(0, 8))
    assert store.prefix([10, 12]) is None and store.prefix([]) is None


def test_a_run_starting_inside_a_block_waits_for_the_next_boundary():
    store = PrefixFeatures(block_size=4, capacity_bytes=1 << 20)
    store.collect("s", 2, rows(2, 8))  # positions 2..9: block 0 incomplete, block 1 whole
    store.seal("s", [10, 11, 12])
    assert store.held([10]) == 0 and store.held([11]) == 1
    assert torch.equal(store.prefix([11]).float(), rows(4, 4))


def test_a_gap_restarts_the_open_run():
    store = PrefixFeatures(block_size=4, capacity_bytes=1 << 20)
    store.collect("s", 0, rows(0, 3))
    store.collect("s", 8, rows(8, 4))  # positions 3..7 never came (a lost step): block 0 and 1 incomplete
    store.seal("s", [10, 11, 12])
    assert store.held([12]) == 1 and len(store) == 1
    store.drop("s")
    store.collect("t", 0, rows(0, 4))
    store.drop("t")  # released before its block was hashed
    store.seal("t", [20])
    assert store.held([20]) == 0


def test_least_recently_used_blocks_leave_first_within_the_byte_bound():
    block_bytes = 4 * HIDDEN * 2  # bf16
    store = PrefixFeatures(block_size=4, capacity_bytes=2 * block_bytes)
    for i, h in enumerate([1, 2]):
        store.collect(f"s{h}", 0, rows(10 * i, 4))
        store.seal(f"s{h}", [h])
    store.prefix([1])  # used: block 2 is now the oldest
    store.collect("s3", 0, rows(50, 4))
    store.seal("s3", [3])
    assert store.held([1]) == 1 and store.held([2]) == 0 and store.held([3]) == 1
    assert store.num_bytes == 2 * block_bytes
    empty = PrefixFeatures(block_size=4, capacity_bytes=0)
    empty.collect("s", 0, rows(0, 4))
    empty.seal("s", [1])
    assert len(empty) == 0


def test_one_draft_call_carries_at_most_the_feature_budget():
    row_bytes = HIDDEN * BYTES_PER_VALUE
    small, large, huge = (0, rows(0, 2)), (5, rows(5, 100)), (0, rows(0, 300))
    assert fit_features([small, None, large], 10_000) == [small, None, large]
    fitted = fit_features([small, large, huge, None], 100 * row_bytes)
    assert fitted[0] is small and fitted[3] is None  # within its share: as it was
    (s1, r1), (s2, r2) = fitted[1], fitted[2]
    assert len(r1) == len(r2) == 49  # (100 - 2) rows shared by the two larger ones
    assert s1 == 5 + 100 - 49 and torch.equal(r1, rows(s1, 49))  # the newest rows, their positions
    assert s2 == 300 - 49 and torch.equal(r2, rows(s2, 49))
    assert sum(len(f[1]) for f in fitted if f is not None) * row_bytes <= 100 * row_bytes


def _seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingConfig(max_tokens=4), None, None, None)


def test_the_scheduler_reuses_only_the_cached_blocks_its_limit_allows():
    blocks = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    blocks.admit("a", blocks.match_prefix(prompt, ""), len(prompt), len(prompt))
    blocks.commit("a", prompt, len(prompt), "")
    hashes = list(blocks.prefix_hashes("a"))
    assert len(hashes) == 4
    seen = []
    scheduler = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64)
    scheduler.prefix_limit = lambda seq, offered: seen.append(offered) or (1 if seq.seq_id == "b" else len(offered))
    for seq_id in ("b", "c"):
        scheduler.add(_seq(seq_id, prompt))
    scheduler.schedule()
    b, c = (s for s in scheduler.running if s.seq_id in ("b", "c"))
    assert seen == [tuple(hashes), tuple(hashes)]
    assert b.num_cached_prompt == 4 and b.num_computed == 4  # one block reused, the rest recomputed
    assert c.num_cached_prompt == 16
    assert blocks.block_table("b")[0] == blocks.block_table("a")[0] != blocks.block_table("b")[1]


def test_a_cut_match_keeps_its_first_blocks_pool_then_host_tier():
    from services.target.engine.block_manager import PrefixMatch
    match = PrefixMatch((7, 8), (11, 12), 16, ((13, "k13"), (14, "k14")))
    assert match.all_hashes == (11, 12, 13, 14)
    assert match.first(4) is match
    assert match.first(3) == PrefixMatch((7, 8), (11, 12), 12, ((13, "k13"),))
    assert match.first(1) == PrefixMatch((7,), (11,), 4, ())
    assert match.first(0).num_tokens == 0 and match.first(0).block_ids == ()
