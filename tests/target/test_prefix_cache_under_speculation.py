"""The prefix cache stays right under speculation.

Verified tokens must be appended before their blocks are hashed; otherwise a block that
crosses a verify boundary is cached under the hash of a truncated token list and a
follow-up turn (prompt + answer + more) reuses little more than the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


from specmesh.proto.v1 import common_pb2
from services.common.sampling_params import SamplingConfig
from services.target.engine.block_manager import block_hash
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.engine.sequence import SpeculationPlan
from tests.mesh import start_draft

BLOCK = 4
PROMPTS = ["1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2",
           "the cat sat on the mat. the cat sat on the mat. the",
           "Once upon a time"]
# The draft is the target model itself, so whole chains are accepted and every verify
# pass commits 5 tokens (4 accepted + bonus) into blocks of 4, crossing block boundaries.
PLAN = SpeculationPlan(common_pb2.SPECULATION_METHOD_DRAFT_MODEL, max_depth=4, max_nodes=4)


@contextlib.asynccontextmanager
async def _spec_engine(model_dir):
    draft = await start_draft(model_dir)
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="float32", num_blocks=512,
                                      block_size=BLOCK, kernels="reference",
                                      draft_address=draft.address, draft_timeout_s=5.0))
    engine.start()
    try:
        for _ in range(500):
            if engine.speculator.client.connected:
                break
            await asyncio.sleep(0.02)
        assert engine.speculator.client.connected
        yield engine
    finally:
        engine.shutdown()
        await draft.stop(grace=0.1)


async def _generate(engine, request_id, prompt_ids, max_tokens, salt, plan):
    tokens, final, done = [], [], threading.Event()

    def emit(out):
        tokens.extend(out.token_ids)
        if out.finish_reason is not None or out.error is not None:
            final.append(out)
            done.set()
    engine.submit(request_id, prompt_ids, SamplingConfig(max_tokens=max_tokens), emit,
                  tenant_salt=salt, plan=plan)
    assert await asyncio.to_thread(done.wait, 120)  # the draft server needs this loop running
    assert final[0].error is None
    return tokens, final[0]


def _chain(token_ids: list[int], extra_key: str) -> list[int]:
    """Chained hashes of every full block of `token_ids`."""
    hashes, parent = [], None
    for i in range(len(token_ids) // BLOCK):
        parent = block_hash(parent, tuple(token_ids[i * BLOCK:(i + 1) * BLOCK]), extra_key)
        hashes.append(parent)
    return hashes


async def test_every_cached_block_hashes_committed_tokens_after_speculation(tiny_llama_dir):
    async with _spec_engine(tiny_llama_dir) as engine:
        await _check_cached_hashes(engine, "tenant-hash-check")


async def _check_cached_hashes(engine, salt):
    expected = set()
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenize(prompt)
        out, final = await _generate(engine, f"hash-{i}", ids, 23, salt, PLAN)
        assert final.speculation.accepted > 0
        # Prompt + output minus the last token (sampled, never fed back) have KV.
        expected |= set(_chain((ids + out)[:-1], f"{engine.name}\x00{salt}"))
    mine = [b for b in engine.blocks.cached_blocks()
            if b.block_hash in expected or b.scope == _scope_of(engine, salt)]
    assert sorted(b.num_tokens for b in mine) == [BLOCK] * len(expected)
    assert {b.block_hash for b in mine} == expected


async def test_multi_turn_reuse_with_speculation_equals_reuse_without(tiny_llama_dir):
    async with _spec_engine(tiny_llama_dir) as engine:
        await _check_multi_turn(engine)


async def _check_multi_turn(engine):
    prompt = engine.tokenize(PROMPTS[1])
    follow_up = engine.tokenize(" and then the dog")
    cached = {}
    for name, plan in (("spec", PLAN), ("plain", None)):
        salt = f"tenant-{name}"  # separate caches for the two runs
        answer, first = await _generate(engine, f"{name}-turn-1", prompt, 21, salt, plan)
        assert first.cached_prompt_tokens == 0
        turn2 = prompt + answer + follow_up
        _, second = await _generate(engine, f"{name}-turn-2", turn2, 4, salt, plan)
        cached[name] = (answer, second.cached_prompt_tokens)
    assert cached["spec"][0] == cached["plain"][0]  # lossless: the same answer
    # Everything with KV from turn 1 (prompt + answer but its last token), in whole blocks.
    whole = (len(prompt) + len(cached["plain"][0]) - 1) // BLOCK * BLOCK
    assert cached["plain"][1] == whole
    assert cached["spec"][1] == whole


def _scope_of(engine, salt: str) -> str:
    from services.target.engine.block_manager import _scope
    return _scope(f"{engine.name}\x00{salt}")
