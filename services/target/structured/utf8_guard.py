"""Keeps UTF-16 surrogates out of constrained output.

A surrogate (U+D800..U+DFFF) written as UTF-8 is the three bytes ED A0..BF 80..BF: not valid
UTF-8. xgrammar's byte-level string rules accept it as one character, but the client receives
it as three U+FFFD, so a finished constrained output could break its own schema (a `maxLength`
of 6 met by xgrammar's count read as 8 by the client's). With a byte-level vocabulary a
sampled request meets such tokens (seen on the tiny test models at T = 0.9).

`Utf8Guard` masks, in a row that samples, every token whose bytes hold ED A0..BF, and, right
after a token that ends with the lead byte ED, every token that starts with A0..BF. Built once
per tokenizer (the constraint compiler holds it).
"""

from __future__ import annotations

import torch


class Utf8Guard:
    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        inner = [i for i, b in enumerate(decoded_vocab[:vocab_size]) if _holds_surrogate(b)]
        after_ed = [i for i, b in enumerate(decoded_vocab[:vocab_size]) if b and 0xA0 <= b[0] <= 0xBF]
        self.inner = torch.tensor(inner, dtype=torch.int64)  # [num_inner] tokens always masked
        self.after_ed = torch.tensor(after_ed, dtype=torch.int64)  # [num_after] masked after a trailing ED
        self.ends_with_ed = frozenset(i for i, b in enumerate(decoded_vocab[:vocab_size]) if b and b[-1] == 0xED)

    def mask_(self, row: torch.Tensor, previous_token: int | None) -> None:
        """row: [vocab] logits, in place: -inf where the next token would write a surrogate."""
        if self.inner.numel():
            row[self.inner.to(row.device)] = float("-inf")
        if previous_token in self.ends_with_ed and self.after_ed.numel():
            row[self.after_ed.to(row.device)] = float("-inf")


def _holds_surrogate(token: bytes) -> bool:
    return any(a == 0xED and 0xA0 <= b <= 0xBF for a, b in zip(token, token[1:]))
