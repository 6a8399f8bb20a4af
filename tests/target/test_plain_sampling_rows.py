"""The plain rows of a step are sampled from where they lie: no copy when they are back to back."""

from __future__ import annotations

import torch

from services.target.engine.plain_sampling import stacked


def test_rows_split_in_order_from_one_tensor_are_a_view_of_it():
    logits = torch.randn(5, 7, dtype=torch.bfloat16)
    rows = [logits[0:1], logits[1:3], logits[3:4]]
    out = stacked(rows)
    assert out.data_ptr() == logits.data_ptr() and torch.equal(out, logits[0:4])


def test_rows_out_of_order_repeated_or_from_elsewhere_are_copied_in_their_order():
    logits = torch.randn(4, 7)
    other = torch.randn(1, 7)
    for rows in ([logits[1:2], logits[0:1]],  # out of order
                 [logits[2:3], logits[2:3]],  # a leader's row and its follower's: the same row twice
                 [logits[0:1], other],  # another tensor
                 [logits[0:1], logits[2:3]]):  # a gap (a verify row between them)
        out = stacked(rows)
        assert torch.equal(out, torch.cat(rows))
        assert out.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()  # a copy
