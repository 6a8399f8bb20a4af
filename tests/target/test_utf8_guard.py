"""No surrogate bytes (ED A0..BF) in constrained output: xgrammar's string rules accept them, the
client would read each byte as U+FFFD (and a maxLength met by xgrammar's count broken)."""

from __future__ import annotations

import torch

from services.target.structured.utf8_guard import Utf8Guard

VOCAB = [b"a", b"\xed", b"\xb6\xbc", b"\x9f\xbf", b"x\xed\xa0\x80", b"\xed\x9f\xbf", b"\xc3\xa9"]


def test_tokens_writing_a_surrogate_are_masked_inside_a_token_and_across_tokens() -> None:
    guard = Utf8Guard(VOCAB, len(VOCAB))
    row = torch.zeros(len(VOCAB))  # [vocab]
    guard.mask_(row, previous_token=0)  # after "a": only the token holding ED A0 80 is out
    assert torch.isinf(row).tolist() == [False, False, False, False, True, False, False]
    row = torch.zeros(len(VOCAB))
    guard.mask_(row, previous_token=1)  # after a trailing ED: A0..BF may not follow (80..9F may)
    assert torch.isinf(row).tolist() == [False, False, True, False, True, False, False]
