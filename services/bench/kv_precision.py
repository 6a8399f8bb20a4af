"""The accuracy cost of the host tier's FP8 copies (services/target/engine/kv_precision.py).

Teacher-forced, as services/bench/quantization.py measures weight formats: a text's prompt is
prefilled into an engine's pool, then its continuation is read (logits at every position) twice:
with the prompt's KV as computed, and after every prompt block went to the engine's host tier and
came back through the model runner's own tier moves (FP8 for the blocks the tier's policy picks,
exact for the rest). At each continuation position: whether the greedy (argmax) choices agree,
and the log-probability the reference's choice loses. `swapped_agreement` measures the same for a
sequence preempted by swap (`BlockManager.swap_out` / `resume`: the tier's policy picks which of
its blocks go FP8) instead of its prompt's blocks evicted and restored.
"""

from __future__ import annotations

import torch

from services.bench.quantization import Agreement
from services.target.engine.block_manager import PrefixMatch, TierMoves
from services.target.model.model_runner_inputs import StepInput

CHUNK = 512  # prefill chunk


def restored_agreement(engine, texts: list[list[int]], prompt_tokens: int) -> Agreement:
    """Over `texts` (token ids: `prompt_tokens` of prompt, then the continuation read teacher-forced).
    Runs on the engine's thread (`engine.run_on_engine_thread`), with no requests in flight; the
    engine's host tier must be on. `prompt_tokens` is a multiple of the block size."""
    runner, blocks, tier = engine.runner, engine.blocks, engine.blocks.host_tier
    bs = blocks.block_size
    if tier is None or prompt_tokens % bs:
        raise ValueError(f"needs the host tier and whole prompt blocks (block size {bs}), got {prompt_tokens}")

    def evict_and_restore(t: int, seq: str, ids: list[int]) -> None:
        table = blocks.block_table(seq)[:prompt_tokens // bs]  # the prompt's blocks
        keys = [(None, (t, i), "kv-precision") for i in range(len(table))]  # private to this measurement
        runner.move_tiers(TierMoves(tier, [(b, hash(k), k, i * bs) for i, (b, k) in enumerate(zip(table, keys))],
                                    []))
        restores = []
        for b, k in zip(table, keys):
            entry = tier.take_entry(hash(k), k)
            if entry is None:
                raise RuntimeError("the host tier did not keep a prompt block: raise its kv_host_bytes")
            restores.append((b, tier.full_bytes(entry)))
        runner.move_tiers(TierMoves(tier, [], restores))
    return _teacher_forced(engine, texts, prompt_tokens, "kv-precision", evict_and_restore)


def swapped_agreement(engine, texts: list[list[int]], prompt_tokens: int) -> Agreement:
    """As `restored_agreement`, the prompt's KV moved out and back by a swap preemption instead:
    the sequence is swapped out after its prompt (`BlockManager.swap_out`, not by cost), resumed into
    fresh blocks (`resume`) and its continuation read again; both moves run through the model
    runner's own tier moves. Engine thread, no requests in flight, host tier on."""
    runner, blocks = engine.runner, engine.blocks
    if blocks.host_tier is None:
        raise ValueError("needs the host tier")

    def swap_and_resume(t: int, seq: str, ids: list[int]) -> None:
        if not blocks.swap_out(seq, prompt_tokens, by_cost=False):
            raise RuntimeError("the host tier has no room for the swap: raise its kv_host_bytes")
        runner.move_tiers(blocks.take_tier_moves())  # copied out (its cold blocks in FP8)
        blocks.resume(seq, len(ids))
        runner.move_tiers(blocks.take_tier_moves())  # copied back into fresh blocks
    return _teacher_forced(engine, texts, prompt_tokens, "kv-swap-precision", swap_and_resume)


def _teacher_forced(engine, texts: list[list[int]], prompt_tokens: int, name: str, round_trip) -> Agreement:
    """Each text's prompt prefilled, its continuation read, `round_trip(t, seq, ids)` moving the
    prompt's KV out and back, the continuation read again: greedy agreement and log-prob gap."""
    runner, blocks = engine.runner, engine.blocks
    positions = agree = 0
    gap = 0.0
    for t, ids in enumerate(texts):
        seq = f"{name}-{t}"
        blocks.admit(seq, PrefixMatch((), (), 0), len(ids), len(ids))
        try:
            for s in range(0, prompt_tokens, CHUNK):
                runner.forward([StepInput.chunk(seq, ids[s:min(s + CHUNK, prompt_tokens)], s, False)])
            tail = ids[prompt_tokens:]
            read = StepInput(seq, tail, list(range(prompt_tokens, len(ids))), prompt_tokens, len(tail))
            ref = torch.log_softmax(runner.forward([read]), -1)  # [continuation, vocab]
            round_trip(t, seq, ids)
            test = torch.log_softmax(runner.forward([read]), -1)
        finally:
            blocks.release(seq)
        choice = ref.argmax(-1)  # [continuation]
        agree += int((test.argmax(-1) == choice).sum())
        gap += float((ref.gather(1, choice[:, None]) - test.gather(1, choice[:, None])).sum())
        positions += len(choice)
    return Agreement(positions, agree / positions, gap / positions)
