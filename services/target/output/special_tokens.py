"""Which token ids are control tokens, not text: skipped in what a client reads by default.

A tokenizer marks its control tokens special (`<bos>`, `<eos>`, `<end_of_turn>`), and
`decode(skip_special_tokens=True)` drops those. A GGUF file can label a control token
user-defined instead: Gemma 3's labels its image markers so (Google's own tokenizer marks
them special), and the tokenizer transformers converts from it calls them plain added
tokens, which decode renders as text. Those are named here. Other plain added tokens stay
text: Gemma's include HTML tags (`<b>`, `</td>`) and runs of spaces, tabs and newlines.
"""

from __future__ import annotations

import weakref

# Control tokens that GGUF conversions leave plain added tokens (GGUF token type 4).
MISLABELLED_CONTROL_TOKENS = ("<start_of_image>", "<end_of_image>", "[multimodal]")
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> frozenset[int]


def control_token_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special tokens plus the mislabelled control tokens it has as added
    tokens; computed once per tokenizer (Gemma's has thousands of added tokens)."""
    ids = _CACHE.get(tokenizer)
    if ids is None:
        found = set(tokenizer.all_special_ids)
        for token_id, added in tokenizer.added_tokens_decoder.items():
            if added.special or added.content in MISLABELLED_CONTROL_TOKENS:
                found.add(token_id)
        ids = _CACHE[tokenizer] = frozenset(found)
    return ids
