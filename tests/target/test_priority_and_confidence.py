"""Target-side parts of routing: tenant priority in the scheduler, confidence in the usage,
and the shared block hashes (router and target compute the same)."""

from __future__ import annotations

import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.block_hash import chained_block_hashes, extra_key
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine


def _engine(model_dir, **overrides) -> Engine:
    config = EngineConfig(model_dir=model_dir, dtype="float32", num_blocks=64, block_size=4,
                          max_batched_tokens=64, max_tokens_limit=64, kernels="reference")
    return Engine.load(EngineConfig(**{**config.__dict__, **overrides}))


def _run(engine, requests) -> tuple[list[str], dict]:
    """Submits (id, prompt, priority, confidence) before the loop starts; waits for all."""
    order, done, all_done = [], {}, threading.Event()
    for request_id, prompt, priority, confidence in requests:
        def emit(out, request_id=request_id):
            if out.token_ids and request_id not in order:
                order.append(request_id)
            if out.finish_reason is not None or out.error is not None:
                done[request_id] = out
                if len(done) == len(requests):
                    all_done.set()
        engine.submit(request_id, engine.tokenize(prompt), SamplingConfig(max_tokens=8), emit,
                      priority=priority, report_confidence=confidence)
    engine.start()
    assert all_done.wait(60)
    return order, done


def test_higher_priority_is_admitted_before_queued_lower_priority(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, max_num_seqs=1)  # one at a time: admission order = service order
    try:
        order, done = _run(engine, [("low-1", "first low", 0, False), ("low-2", "second low", 0, False),
                                    ("high", "urgent one", 5, False), ("low-3", "third low", 0, False),
                                    ("mid", "middle one", 1, False)])
        assert order == ["high", "mid", "low-1", "low-2", "low-3"]
        assert all(out.error is None for out in done.values())
    finally:
        engine.shutdown()


def test_lowest_priority_youngest_is_preempted_first(tiny_llama_dir):
    from services.target.engine.block_manager import BlockManager
    from services.target.engine.scheduler import Scheduler
    from services.target.engine.sequence import Sequence
    from services.target.metrics import Timeline

    def seq(name, priority, arrival):
        return Sequence(name, [1] * 8, SamplingConfig(max_tokens=4), None, None, None,
                        priority=priority, timeline=Timeline(arrival))
    blocks = BlockManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_batched_tokens=64)
    old_low, young_high, young_low = seq("old-low", 0, 1.0), seq("young-high", 3, 3.0), seq("young-low", 0, 2.0)
    for s in (old_low, young_high, young_low):
        scheduler.add(s)
    assert [s.seq_id for s in scheduler.waiting] == ["young-high", "old-low", "young-low"]
    scheduler.schedule()  # admits all three: 2 blocks each, 6 blocks
    assert blocks.num_free == 0
    for s in scheduler.running:  # pretend the prompts were computed and one token was added
        s.num_computed = s.num_tokens
        s.token_ids.append(1)
    scheduler.schedule()  # the first decode needs a 3rd block: a low-priority one is preempted
    assert [s.seq_id for s in scheduler.waiting] == ["young-low"]  # lowest priority, youngest
    assert {s.seq_id for s in scheduler.running} == {"young-high", "old-low"}


def test_confidence_equals_the_models_own_log_probs(tiny_llama_dir):
    prompt = "Once upon a time"
    engine = _engine(tiny_llama_dir)
    try:
        _, done = _run(engine, [("conf", prompt, 0, True), ("plain", prompt, 0, False)])
    finally:
        engine.shutdown()
    out = done["conf"]
    assert done["plain"].confidence is None  # only requests that ask pay for it
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt).input_ids
    generated = []
    logprobs, margins = [], []
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([ids + generated])).logits[0, -1]
            lp = torch.log_softmax(logits, -1)
            top = torch.topk(lp, 2).values
            token = int(lp.argmax())
            generated.append(token)
            logprobs.append(float(lp[token]))
            margins.append(float(top[0] - top[1]))
    assert out.confidence.count == 8
    assert abs(out.confidence.mean_logprob - sum(logprobs) / 8) < 1e-4
    assert abs(out.confidence.min_logprob - min(logprobs)) < 1e-4
    assert abs(out.confidence.mean_margin - sum(margins) / 8) < 1e-4


def test_router_and_target_hash_the_same_blocks(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    try:
        _run(engine, [("a", "The same long system prompt for every question. Q1", 0, False)])
        ids = engine.tokenize("The same long system prompt for every question. Q1")
        cached = {e.block_hash for e in engine.blocks.cached_blocks()}
        expected = chained_block_hashes(ids, 4, extra_key(engine.name, ""))
        assert len(expected) == len(ids) // 4 and set(expected) <= cached
        other_tenant = chained_block_hashes(ids, 4, extra_key(engine.name, "salt-x"))
        assert not set(other_tenant) & cached  # another salt, other hashes
    finally:
        engine.shutdown()
