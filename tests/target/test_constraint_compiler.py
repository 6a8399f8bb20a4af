"""The constraint compiler: one compile per (tokenizer, constraint) even when requests arrive
together, keys that tell tokenizers apart, and JSON strings that stay JSON."""

from __future__ import annotations

import asyncio
import json

import xgrammar as xgr

from services.common.constraints import ConstraintSpec
from services.common.models.tiny import TINY_VOCAB_SIZE, build_tiny_tokenizer
from services.target.structured.compiler import ConstraintCompiler
from services.target.structured.grammar_state import GrammarState
from tests.structured import PERSON_SCHEMA

SPEC = ConstraintSpec("json_schema", json.dumps(PERSON_SCHEMA))


async def test_concurrent_requests_for_one_constraint_compile_it_once():
    compiler = ConstraintCompiler(build_tiny_tokenizer(), TINY_VOCAB_SIZE, {2})
    try:
        grammars = await asyncio.gather(*(compiler.compile(SPEC) for _ in range(8)))
        assert compiler.compiles == 1 and all(g is grammars[0] for g in grammars)
        await compiler.compile(ConstraintSpec("regex", "[ab]+"))
        assert compiler.compiles == 2
    finally:
        compiler.close()


def test_the_cache_key_tells_tokenizers_apart():
    plain = ConstraintCompiler(build_tiny_tokenizer(), TINY_VOCAB_SIZE, {2})
    chat = ConstraintCompiler(build_tiny_tokenizer(chat=True), TINY_VOCAB_SIZE + 2, {2, 385})
    again = ConstraintCompiler(build_tiny_tokenizer(), TINY_VOCAB_SIZE, {2})
    assert plain.key(SPEC) != chat.key(SPEC)
    assert plain.key(SPEC) == again.key(SPEC)
    for c in (plain, chat, again):
        c.close()


async def test_length_limited_json_strings_admit_no_raw_control_characters():
    """xgrammar 0.2.9 lets a maxLength string hold raw control characters (invalid JSON)."""
    tokenizer = build_tiny_tokenizer()
    compiler = ConstraintCompiler(tokenizer, TINY_VOCAB_SIZE, {2})
    try:
        state = GrammarState(await compiler.compile(SPEC), TINY_VOCAB_SIZE)
        for token in tokenizer.encode('{"name": "', add_special_tokens=False):
            state.commit(token)
        bitmask = xgr.allocate_token_bitmask(1, TINY_VOCAB_SIZE)
        state.matcher.fill_next_token_bitmask(bitmask)
        allowed = {t for t in range(TINY_VOCAB_SIZE) if bitmask[0, t // 32] >> (t % 32) & 1}
        control = {t for t in range(4, TINY_VOCAB_SIZE)
                   if any(ord(ch) < 0x20 for ch in tokenizer.decode([t]))}
        assert control and not allowed & control
        assert tokenizer.convert_tokens_to_ids("a") in allowed
    finally:
        compiler.close()
