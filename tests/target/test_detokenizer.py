"""Incremental detokenization equals decoding everything at once; stop text never leaks."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from services.target.output.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_pieces_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    text = "héllo wörld — ünïcode ✓ and plain words, numbers 12345 😀 end"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    for _ in range(20):
        sample = [rng.choice(ids) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [1], ())
        pieces = [detok.add([t]) for t in sample] + [detok.flush()]
        assert "".join(pieces) == tokenizer.decode(sample, skip_special_tokens=True)


def test_stop_sequence_is_cut_and_never_emitted(tokenizer):
    ids = tokenizer("alpha beta STOP gamma", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], ("STOP",))
    pieces = []
    for t in ids:
        pieces.append(detok.add([t]))
        if detok.stopped:
            break
    assert detok.stopped
    assert "".join(pieces) == "alpha beta "
