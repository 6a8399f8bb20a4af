"""Forced drafts in the model tokenizer's own spelling (slow: the default model's tokenizer).

xgrammar's jump-forward tokens spell `_` with Gemma 3's byte token <0x5F>, which the model never
writes: every forced key with an underscore was rejected at that token. The grammar state
proposes the forced text as the tokenizer writes it wherever the grammar accepts that, and
keeps xgrammar's tokens otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from services.common.models.prepare import prepare_default_model
from services.settings import read_settings
from services.target.structured.grammar_state import GrammarState

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["email_address"],
          "properties": {"email_address": {"type": "string"}}}


@pytest.fixture(scope="module")
def gemma():
    model_dir = prepare_default_model(Path(read_settings().model_cache).expanduser() / "gemma-3-270m", progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = 262144
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    return tok, compiled, vocab


def test_forced_tokens_are_the_tokenizers_spelling_where_the_grammar_accepts_it(gemma):
    tok, compiled, vocab = gemma
    byte_underscore = tok.convert_tokens_to_ids("<0x5F>")
    xgrammar_only = GrammarState(compiled, vocab)
    native = GrammarState(compiled, vocab, encode=lambda text: tok.encode(text, add_special_tokens=False))
    assert byte_underscore in xgrammar_only.forced_tokens(16)  # why the tokenizer's spelling is asked
    want = tok.encode('{"email_address": "', add_special_tokens=False)
    assert native.forced_tokens(16) == want and byte_underscore not in want
    assert native.forced_tokens(3) == want[:3]
    for token in want:  # the chain is what the grammar accepts, and reading it left the state as it was
        native.commit(token)
    assert native.num_committed == len(want)


def test_a_spelling_the_grammar_refuses_falls_back_to_xgrammars_tokens(gemma):
    tok, compiled, vocab = gemma
    wrong = GrammarState(compiled, vocab, encode=lambda text: tok.encode(" " + text, add_special_tokens=False))
    assert wrong.forced_tokens(16) == GrammarState(compiled, vocab).forced_tokens(16)
    assert wrong.num_committed == 0 and not wrong.terminated
