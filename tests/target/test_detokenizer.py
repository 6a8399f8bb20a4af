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


# ---- special tokens ---------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_like_tokenizer(tiny_llama_dir):
    """The tiny tokenizer plus an image marker and an HTML tag added as plain (not special)
    tokens, as the default model's tokenizer converted from GGUF has them."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.add_tokens(["<start_of_image>", "<b>"])
    return tokenizer


def _stream(tokenizer, ids, stop=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, [1], stop, skip_special_tokens)
    pieces = []
    for t in ids:
        pieces.append(detok.add([t]))
        if detok.stopped:
            return "".join(pieces), True
    return "".join(pieces) + detok.flush(), False


def test_special_and_added_control_tokens_are_skipped_unless_asked(gguf_like_tokenizer):
    tok = gguf_like_tokenizer
    image = tok.convert_tokens_to_ids("<start_of_image>")
    alpha, beta = (tok(t, add_special_tokens=False).input_ids for t in ("alpha", " beta"))
    ids = [*alpha, tok.unk_token_id, image, tok.pad_token_id, *beta]
    assert tok.decode(ids, skip_special_tokens=True) == "alpha<start_of_image> beta"  # what leaked
    assert _stream(tok, ids) == ("alpha beta", False)
    assert _stream(tok, ids, skip_special_tokens=False) == ("alpha<unk><start_of_image><pad> beta", False)
    bold = tok.convert_tokens_to_ids("<b>")  # a plain added token that is text
    assert _stream(tok, [*alpha, bold, image, *beta]) == ("alpha<b> beta", False)


def test_a_control_token_never_splits_a_character(gguf_like_tokenizer):
    tok = gguf_like_tokenizer
    image = tok.convert_tokens_to_ids("<start_of_image>")
    ids = tok("😀", add_special_tokens=False).input_ids
    assert len(ids) >= 2  # the emoji's bytes come as several tokens
    for cut in range(1, len(ids)):
        assert _stream(tok, [*ids[:cut], image, tok.bos_token_id, *ids[cut:]]) == ("😀", False)


def test_a_stop_sequence_spanning_a_control_token_matches(gguf_like_tokenizer):
    tok = gguf_like_tokenizer
    image = tok.convert_tokens_to_ids("<start_of_image>")
    ab, cd = (tok(t, add_special_tokens=False).input_ids for t in ("one ab", "cd two"))
    ids = [*ab, image, *cd]
    assert _stream(tok, ids, stop=("bcd",)) == ("one a", True)
    # Shown, the marker sits between b and c: the client's text has no "bcd".
    assert _stream(tok, ids, stop=("bcd",), skip_special_tokens=False) == ("one ab<start_of_image>cd two", False)


@pytest.mark.slow
def test_the_default_models_control_tokens_are_skipped_and_its_text_tokens_kept():
    from pathlib import Path

    from services.settings import read_settings
    from services.common.models.prepare import prepare_default_model
    from services.target.output.special_tokens import control_token_ids

    settings = read_settings()
    tok = AutoTokenizer.from_pretrained(prepare_default_model(
        Path(settings.model_cache).expanduser() / "gemma-3-270m", progress=False))
    markers = ("<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
               "[multimodal]", "<unused0>")
    assert {tok.convert_tokens_to_ids(m) for m in markers} <= control_token_ids(tok)
    text = "Hello\n\n\tworld <b>bold</b>, [x] 日本語"  # newlines and tabs are added tokens too
    assert not set(tok(text, add_special_tokens=False).input_ids) & control_token_ids(tok)
    # The answer of issue 31, as sampled: the image marker rendered as text.
    before, after = (tok(t, add_special_tokens=False).input_ids for t in (", I made it short.", "I forgot"))
    ids = [*before, tok.convert_tokens_to_ids("<start_of_image>"), *after]
    assert "<start_of_image>" in tok.decode(ids, skip_special_tokens=True)
    assert _stream(tok, ids) == (", I made it short.I forgot", False)
