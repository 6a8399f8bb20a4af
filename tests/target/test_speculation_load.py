"""Load-aware speculation: the target's per-step depth starts from the router's predicted
acceptance and protects the first token of a request prefilled in the step or arriving while
it runs (TTFT); shared cost pieces live in services/common/speculation_cost.py."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from services.common.sampling_params import SamplingConfig
from services.common.speculation_cost import LoadAwareDepth, StepCostModel, expected_tokens, sequence_alpha
from services.router.speculation_policy import PolicyConfig, SpeculationPolicy, acceptance_prior
from services.target.output.detokenizer import IncrementalDetokenizer
from services.target.engine.block_manager import BlockManager
from services.target.engine.scheduler import ArrivalRate, ScheduledSeq, Scheduler
from services.target.engine.sequence import Sequence, SpeculationPlan
from services.target.server.service import _plan
from services.target.speculation.speculator import Speculator
from specmesh.proto.v1 import common_pb2
from tests.mesh import collect, request, start_draft, start_mesh
from tests.target.test_speculation import PROMPTS


def _chooser(a: float, b: float, draft_s: float, c: float | None = None, e: float = 0.0) -> LoadAwareDepth:
    """Measured steps t = a + b·tokens + c·logit rows + e·draft trees (c = b unless given),
    draft call draft_s."""
    c = b if c is None else c
    chooser = LoadAwareDepth(StepCostModel(decay=1.0, min_steps=2))
    for tokens, rows, trees in ((1, 1, 0), (10, 10, 0), (100, 1, 0), (100, 100, 0), (24, 24, 4)):
        chooser.cost.observe(tokens, a + b * tokens + c * rows + e * trees, rows, trees)
    chooser.observe_draft(draft_s)
    return chooser


def test_step_cost_model_prices_logit_rows_apart_from_tokens():
    # A prompt chunk computes many tokens and one logit row; a verify pass one row per node.
    chooser = _chooser(a=0.02, b=0.0005, c=0.002, draft_s=0.0)
    a, b, c, e = chooser.cost.coefficients()
    assert (a, b, c, e) == (pytest.approx(0.02), pytest.approx(0.0005), pytest.approx(0.002), pytest.approx(0.0))
    assert chooser.cost.predict(40, 40) == pytest.approx(0.02 + 40 * 0.0025)  # 8 sequences at depth 4
    assert chooser.cost.predict(40, 1) == pytest.approx(0.02 + 40 * 0.0005 + 0.002)  # a 40-token prompt


def test_a_draft_tree_costs_a_step_time_of_its_own():
    # Measured here: a verify pass costs far more than its logit rows (masked attention outside
    # the batched decode path, accept and compaction per tree). 30 ms + 0.2 ms per token and per
    # logit row + 4 ms per tree; eight idle sequences at α = 0.8, draft call 1 ms.
    chooser = _chooser(a=0.030, b=0.0002, draft_s=0.001, e=0.004)
    assert chooser.cost.coefficients()[3] == pytest.approx(0.004)
    assert chooser.cost.predict(24, 24, 4) == pytest.approx(0.030 + 24 * 0.0004 + 4 * 0.004)
    # Plain: 8 tokens in 33.2 ms (241/s). At α = 0.5, depth d takes 66.2 + 3.2·d ms for
    # 16·(1 - 0.5^(d+1)) tokens: at most 174/s (d = 8), so no speculation; priced without the
    # trees, depth 2 (14 tokens in 40.6 ms, 345/s) would look best.
    assert chooser.choose(0, 0, [0.5] * 8, [8] * 8) == [0] * 8
    assert _chooser(a=0.030, b=0.0002, draft_s=0.001).choose(0, 0, [0.5] * 8, [8] * 8) == [2] * 8
    # Copy-heavy sequences still pay for their trees, deeper ones (the fixed cost amortised).
    assert chooser.choose(0, 0, [0.8] * 8, [8] * 8) == [8] * 8


def test_a_prefill_step_speculates_only_within_the_ttft_slack():
    # Memory-bound: 30 ms + 0.05 ms per token and per logit row, draft call 1 ms; two
    # sequences at α = 0.8.
    idle = _chooser(a=0.030, b=0.00005, draft_s=0.001)
    assert idle.choose(0, 0, [0.8, 0.8], [8, 8]) == [8, 8]
    # Beside a 100-token prefill (1 logit row): the plain step takes 30 + 5.1 + 0.15 ms, 5% more
    # is 37.01 ms; the draft call and n draft nodes cost 36.25 + 0.1·n ms, so at most 7 nodes.
    assert idle.choose(100, 1, [0.8, 0.8], [8, 8], prefill_tokens=100) == [4, 3]
    # A draft call longer than the slack: no speculation beside a prefill, as much as ever without.
    slow_draft = _chooser(a=0.030, b=0.00005, draft_s=0.01)
    assert slow_draft.choose(100, 1, [0.8, 0.8], [8, 8], prefill_tokens=100) == [0, 0]
    assert slow_draft.choose(100, 1, [0.8, 0.8], [8, 8]) == [8, 8]
    # Before the cost model has data: the plan as asked, but not beside a prefill.
    assert LoadAwareDepth().choose(0, 0, [0.5], [5]) == [5]
    assert LoadAwareDepth().choose(10, 1, [0.5], [5], prefill_tokens=10) == [0]


def test_a_step_that_requests_may_arrive_in_speculates_within_the_expected_ttft_slack():
    # Memory-bound: 30 ms + 0.2 ms per token and per logit row, draft call 1 ms; eight
    # sequences at α = 0.8. The plain step takes 33.2 ms; 5% of it is 1.66 ms.
    chooser = _chooser(a=0.030, b=0.0002, draft_s=0.001)
    alphas, limits = [0.8] * 8, [8] * 8
    assert chooser.choose(0, 0, alphas, limits) == [6] * 8  # nobody arriving: the rows' time per token decides
    # 4 requests a second: 23 draft nodes (43.4 ms) are waited for by an arrival with chance
    # 1 - exp(-4 · 0.0434) = 0.16, an expected 0.16 · 10.2 = 1.62 ms; a 24th node 1.72 ms.
    assert chooser.choose(0, 0, alphas, limits, arrival_rate=4.0) == [3] * 7 + [2]
    # The faster they arrive, the fewer the draft nodes. A certain arrival is a prefill step:
    # one node and the draft call (1.4 ms) fit in its 1.66 ms, but would make seven of the
    # eight rows wait longer per token for one row's gain.
    assert [sum(chooser.choose(0, 0, alphas, limits, arrival_rate=r)) for r in (3.0, 10.0, 20.0)] == [29, 10, 5]
    assert chooser.choose(0, 0, alphas, limits, prefill_tokens=1) == [0] * 8


def test_arrival_rate_counts_recent_arrivals_and_falls_when_they_stop():
    rate = ArrivalRate(window=4)
    rate.observe(0.0)
    assert rate.rate(0.0) == 0.0  # one arrival says nothing about a rate
    for t in (0.5, 1.0, 1.5, 2.0):
        rate.observe(t)
    assert rate.rate(2.0) == pytest.approx(2.0)  # the last 4: 3 gaps in 1.5 s
    assert rate.rate(6.5) == pytest.approx(0.5)  # nothing since: 3 arrivals in 6 s


def test_sequence_alpha_starts_from_the_router_prior():
    assert sequence_alpha(0, 0, 0.75) == pytest.approx(0.75)
    assert sequence_alpha(0, 0) == sequence_alpha(0, 0, 0.0) == pytest.approx(0.3)  # no prediction
    assert sequence_alpha(6, 0, 0.75) == pytest.approx(1.5 / 8)  # its own counts take over


def _seq(tokenizer, name: str, plan: SpeculationPlan | None, prompt_len: int = 6) -> Sequence:
    ids = list(range(5, 5 + prompt_len))
    return Sequence(name, ids, SamplingConfig(max_tokens=32), None,
                    IncrementalDetokenizer(tokenizer, ids, ()), None, plan=plan)


def _aware(acceptance: float) -> SpeculationPlan:
    return SpeculationPlan(common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP, max_depth=5, max_nodes=5,
                           load_aware=True, acceptance=acceptance)


def _decoding(seq: Sequence) -> ScheduledSeq:
    seq.token_ids.append(7)  # its prompt is computed and one token sampled
    return ScheduledSeq(seq, seq.num_tokens - 1, 1, num_draft_slots=5)


def test_target_depth_follows_the_router_prior_and_yields_to_a_prefill(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    speculator = Speculator(None, None, max_context=1024, metrics=None)
    # Compute-bound: 30 ms + 10 ms per token and per logit row, draft call 2 ms. At α = 0.3
    # (no prediction) nothing beats plain decoding (1/50 tokens per ms) by 5%; at α = 0.75,
    # depth 2 maximises tokens per second (1.75/72, 2.31/92, 2.73/112 for depths 1-3).
    speculator.load = _chooser(a=0.030, b=0.010, draft_s=0.002)
    copy = _seq(tokenizer, "copy", _aware(0.75))
    unknown = _seq(tokenizer, "unknown", _aware(0.0))
    assert [(s.seq_id, d) for s, d in speculator._depths([_decoding(copy)])] == [("copy", 2)]
    assert speculator._depths([_decoding(unknown)]) == []
    # The same copy-heavy sequence beside a waiting request's 6-token prefill: the step would
    # get more than 5% longer, so it decodes plainly.
    copy2, new = _seq(tokenizer, "copy2", _aware(0.75)), _seq(tokenizer, "new", None)
    assert speculator._depths([_decoding(copy2), ScheduledSeq(new, 0, new.num_tokens)]) == []


def test_target_depth_shortens_while_the_scheduler_sees_requests_arrive(tiny_llama_dir):
    """Tool-like requests (short prompts, no speculation of their own) arriving at a busy
    target wait for the step in flight before their prefill starts: the speculator reads the
    scheduler's arrival rate (as the engine wires it) and keeps that wait within the slack."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    speculator = Speculator(None, None, max_context=1024, metrics=None)
    speculator.load = _chooser(a=0.030, b=0.0002, draft_s=0.001)  # as in the test above
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=32,
                          max_batched_tokens=256, draft_limit=speculator.max_draft_nodes)
    speculator.arrival_rate = scheduler.arrival_rate
    batch = [_decoding(_seq(tokenizer, f"copy{i}", _aware(0.8))) for i in range(8)]
    assert {d for _, d in speculator._depths(batch)} == {5}  # no arrivals: the plan's depth
    now = time.monotonic()
    for i in range(9):  # a request every 0.1 s up to now: 10 a second (10 nodes, as above)
        tool = _seq(tokenizer, f"tool{i}", None)
        tool.timeline.arrival = now - 0.1 * (8 - i)
        scheduler.add(tool)
    assert sorted(d for _, d in speculator._depths(batch)) == [1] * 6 + [2] * 2


def test_router_plan_carries_the_predicted_acceptance_to_the_target():
    policy = SpeculationPolicy(PolicyConfig(mode="adaptive"), default_depth=5)
    depth, alpha = policy.plan("rewrite-short-greedy", max_tokens=64, temperature=0.0)
    assert alpha == acceptance_prior("rewrite-short-greedy", 0.0) == 0.75 and depth >= 1
    assert policy.plan("rewrite-short-greedy", max_tokens=8, temperature=0.0) == (0, None)
    assert SpeculationPolicy(PolicyConfig(mode="fixed"), default_depth=5).plan("rewrite-short-greedy") == (5, None)
    message = common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP, max_depth=3,
                                         load_aware=True, acceptance_prior=0.75)
    assert _plan(message).acceptance == pytest.approx(0.75)
    message.acceptance_prior = 0.0
    assert _plan(message).acceptance == 0.0  # no prediction: the target's flat prior


async def test_adaptive_mesh_sends_the_prior_in_the_plan(tiny_llama_dir):
    """Router -> target over gRPC: the plan the engine receives holds the router's prediction."""
    draft = await start_draft(tiny_llama_dir)
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, speculation={
        "speculation_method": "draft_model", "speculation_depth": 2, "speculation_policy": "adaptive"})
    plans = []
    submit = mesh.engine.submit

    def recording_submit(*args, **kwargs):  # the real submit, its plan noted
        plans.append(kwargs.get("plan"))
        return submit(*args, **kwargs)
    mesh.engine.submit = recording_submit
    try:
        await collect(mesh.router_stub, request(PROMPTS[3], 16))
        assert len(plans) == 1 and plans[0].load_aware
        # The engine's speculator weighs the arrivals its scheduler counts.
        assert mesh.engine.speculator.arrival_rate == mesh.engine.scheduler.arrival_rate
        assert plans[0].acceptance == pytest.approx(acceptance_prior("chat-short-greedy", 0.0))
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)


def test_a_queued_request_bounds_the_step_like_a_prefill():
    # Memory-bound as above: two sequences at α = 0.8 would draft 8 deep when nobody waits.
    idle = _chooser(a=0.030, b=0.00005, draft_s=0.001)
    assert idle.choose(0, 0, [0.8, 0.8], [8, 8]) == [8, 8]
    # A request queued behind the step (no seat for it) waits for all of it, whatever the
    # arrival rate: the same bound as a prefill in the step. Plain: 30.2 ms, 5% = 1.51 ms;
    # the 1 ms draft call and 0.1 ms per node: at most 5 nodes.
    assert idle.choose(0, 0, [0.8, 0.8], [8, 8], waiting=1) == [3, 2]
    assert LoadAwareDepth().choose(0, 0, [0.5], [5], waiting=1) == [0]  # unmeasured: not beside a queue


def test_a_queued_request_gets_no_seat_later_for_a_slower_row():
    # A queued request waits until a seated sequence finishes: near saturation that wait is the
    # first-token tail, and 5% slower seats made it ~40% later at 85% load (issue 32). So with
    # a queue, no row of the step may get its tokens more slowly than plain (model margin 5%).
    idle = _chooser(a=0.030, b=0.00005, draft_s=0.001)
    # A plain row beside the candidate gains nothing from any draft: nobody speculates, where
    # without the queue the candidate drafts 8 deep (and 5 with all seats taken).
    assert idle.choose(1, 1, [0.8], [8]) == [8]
    assert idle.choose(1, 1, [0.8], [8], full=True) == [5]
    assert idle.choose(1, 1, [0.8], [8], waiting=1) == [0]
    # Candidates that all gain speed up every row: allowed (within the first-token slack), each
    # row faster by the margin.
    depths = idle.choose(0, 0, [0.9, 0.6], [8, 8], waiting=1)
    plain = idle.cost.predict(2, 2)
    nodes = sum(depths)
    spec = idle.cost.predict(2 + nodes, 2 + nodes, 2) + 0.001
    assert all(depths) and spec <= 1.05 * plain
    assert spec * 1.05 <= plain * min(expected_tokens(0.9, depths[0]), expected_tokens(0.6, depths[1]))
    # One candidate that accepts almost nothing holds back both.
    assert idle.choose(0, 0, [0.9, 0.01], [8, 8], waiting=1) == [0, 0]


def test_each_sequence_drafts_as_deep_as_its_own_acceptance_pays():
    # The k-th node of a chain at α adds α^k tokens: the step verifies the best nodes, whoever's,
    # to cut its rows' time per token (summed over rows: the step's time over each row's E[A]).
    # 30 ms + 0.5 ms per token and per logit row, draft call 1 ms, nobody waiting.
    chooser = _chooser(a=0.030, b=0.00025, draft_s=0.001)
    alphas = [0.9, 0.85, 0.3, 0.6, 0.02]  # the last below min_alpha: never drafts
    depths = chooser.choose(0, 0, alphas, [5] * 5)
    assert depths[0] == depths[1] == 5 and 0 < depths[2] < depths[3] < 5 and depths[4] == 0

    def per_token(ds):
        nodes = sum(ds)
        t = chooser.cost.predict(5 + nodes, 5 + nodes, sum(1 for d in ds if d)) + (0.001 if nodes else 0)
        return sum(t / expected_tokens(a, d) for a, d in zip(alphas, ds))
    # Better than decoding plainly, and than any one depth for every row that may draft.
    assert per_token(depths) < per_token([0] * 5) / 1.05
    assert all(per_token(depths) < per_token([d] * 4 + [0]) for d in range(1, 6))


def test_verify_rows_never_push_a_queued_first_token_past_the_bound(tiny_llama_dir):
    """The scheduler and the speculator together, on a deterministic step-cost model: two
    seats, both decoding with load-aware plans, a third request queued for a seat. Every step
    it waits through may be at most 5% longer than plain (its first token at most 5% later);
    once nobody waits, the plans draft at full depth."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    speculator = Speculator(None, None, max_context=1024, metrics=None)
    speculator.load = _chooser(a=0.030, b=0.00005, draft_s=0.001)  # the test's clock
    scheduler = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_num_seqs=2,
                          max_batched_tokens=64, draft_limit=speculator.max_draft_nodes)
    speculator.queue_length = lambda: len(scheduler.waiting)
    plan = SpeculationPlan(common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP, max_depth=8, max_nodes=8,
                           load_aware=True, acceptance=0.8)
    running = [_seq(tokenizer, f"run{i}", plan) for i in range(2)]
    queued = _seq(tokenizer, "queued", None)
    for seq in (*running, queued):
        scheduler.add(seq)
    for item in scheduler.schedule():  # both prefilled; the third has no seat
        item.seq.num_computed = item.seq.num_tokens
        item.seq.token_ids.append(7)
    cost = speculator.load.cost

    def step_time(batch, depths) -> float:
        nodes = sum(depths.values())
        return cost.predict(len(batch) + nodes, len(batch) + nodes, sum(1 for d in depths.values() if d)) + \
            (speculator.load.draft_seconds if nodes else 0.0)

    batch = scheduler.schedule()
    assert [i.seq.seq_id for i in batch] == ["run0", "run1"] and list(scheduler.waiting) == [queued]
    assert all(i.num_draft_slots == 8 for i in batch)  # the budget left room for full trees
    depths = {s.seq_id: d for s, d in speculator._depths(batch)}
    plain = step_time(batch, {})
    assert depths and step_time(batch, depths) <= 1.05 * plain  # it speculates, within the bound
    scheduler.remove(queued)  # nobody waits any more
    depths = {s.seq_id: d for s, d in speculator._depths(batch)}
    assert depths == {"run0": 8, "run1": 8}


def test_a_full_step_never_slows_a_plain_row_past_the_tpot_slack():
    # One plain decode row beside one candidate at α = 0.8. Plain: 30.2 ms; depth d adds the
    # 1 ms draft call and 0.1·d ms. Below saturation the batch's rate decides: depth 8. With
    # every seat taken, the plain row's one token may cost at most 5% more (31.71 ms): d <= 5.
    chooser = _chooser(a=0.030, b=0.00005, draft_s=0.001)
    assert chooser.choose(1, 1, [0.8], [8]) == [8]
    assert chooser.choose(1, 1, [0.8], [8], full=True) == [5]
    # A candidate that accepts little is a row that gains little: at α = 0.1 a verify pass
    # yields ~1.1 tokens, so full steps may grow ~10% for it, but not the 40% of depth 8 that
    # its batch-mate at α = 0.9 alone would draft when the step's slope is steep.
    steep = _chooser(a=0.030, b=0.0005, draft_s=0.001)
    assert steep.choose(0, 0, [0.9, 0.1], [8, 8]) == [8, 1]
    full = steep.choose(0, 0, [0.9, 0.1], [8, 8], full=True)
    plain = steep.cost.predict(2, 2)
    nodes = sum(full)
    assert all(full) and full != [8, 8]
    assert steep.cost.predict(2 + nodes, 2 + nodes, 2) + 0.001 <= 1.05 * plain * expected_tokens(0.1, full[1])


def test_verify_rows_never_slow_a_seated_plain_row_past_the_bound_when_seats_are_full(tiny_llama_dir):
    """The scheduler and the speculator on a deterministic step-cost model: a speculating
    sequence beside one that decodes plainly. With a free seat the plan drafts at full depth;
    once every seat is taken the plain row's time per token grows at most 5%."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for seats, expect_full in ((3, False), (2, True)):
        speculator = Speculator(None, None, max_context=1024, metrics=None)
        speculator.load = _chooser(a=0.030, b=0.00005, draft_s=0.001)
        scheduler = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_num_seqs=seats,
                              max_batched_tokens=64, draft_limit=speculator.max_draft_nodes)
        speculator.seats_full = scheduler.seats_full
        plan = SpeculationPlan(common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP, max_depth=8, max_nodes=8,
                               load_aware=True, acceptance=0.8)
        for seq in (_seq(tokenizer, "spec", plan), _seq(tokenizer, "plain", None)):
            scheduler.add(seq)
        for item in scheduler.schedule():
            item.seq.num_computed = item.seq.num_tokens
            item.seq.token_ids.append(7)
        batch = scheduler.schedule()
        assert scheduler.seats_full() is expect_full
        depths = {s.seq_id: d for s, d in speculator._depths(batch)}
        cost = speculator.load.cost
        plain = cost.predict(2, 2)
        spec = cost.predict(2 + depths["spec"], 2 + depths["spec"], 1) + 0.001
        if expect_full:
            assert 0 < depths["spec"] < 8 and spec <= 1.05 * plain  # the plain row pays at most 5%
        else:
            assert depths == {"spec": 8}


def test_a_grammars_forced_chain_is_priced_apart_from_rejected_free_drafts(tiny_llama_dir):
    """A constrained sequence whose prompt-lookup drafts were all rejected (its free text is
    not in the prompt) still drafts what its grammar forces: those drafts have their own
    acceptance (the constraint fixes the text, only its tokenisation can be refused), counted
    apart, and cost no draft call. Mixed into one estimate, one rejected free draft stopped
    every forced chain after it (the structured-outputs benchmark at T = 0.8: no verify pass)."""
    import xgrammar as xgr

    from services.target.structured.grammar_state import GrammarState
    from tests.structured import ORDER_SCHEMA

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(ORDER_SCHEMA), any_whitespace=False)
    speculator = Speculator(None, None, max_context=1024, metrics=None)
    # 30 ms a step, 0.2 ms per token and logit row, a 1 ms draft call: a free draft at the
    # router's α = 0.6 pays (depth 5), one that accepted 0 of 12 does not (α = 0.09).
    speculator.load = _chooser(a=0.030, b=0.0002, draft_s=0.001)
    free, constrained = _seq(tokenizer, "free", _aware(0.6)), _seq(tokenizer, "constrained", _aware(0.6))
    constrained.grammar = GrammarState(compiled, len(tokenizer))
    assert [d for _, d in speculator._depths([_decoding(free)])] == [5]
    for seq in (free, constrained):
        seq.spec.proposed, seq.spec.accepted = 12, 0  # every prompt-lookup draft rejected
    assert speculator._depths([_decoding(free)]) == []
    forced = constrained.grammar.forced_tokens(5)  # '{"' and the first key: fixed text
    assert len(forced) == 5
    trees = speculator.propose([_decoding(constrained)])  # no draft service is asked (client None)
    assert list(trees["constrained"].token_ids) == forced
    # Its forced drafts' own record decides: a tokenisation the model always refused stops them.
    constrained.spec.forced_proposed, constrained.spec.forced_accepted = 40, 0
    constrained.spec.proposed += 40
    assert speculator.propose([_decoding(constrained)]) == {}


def _choose_by_definition(chooser: LoadAwareDepth, plain_tokens, plain_outputs, alphas, max_depths,
                          prefill_tokens=0, plain_logits=None, arrival_rate=0.0, plain_trees=0,
                          waiting=0, full=False, draft_calls=None) -> list[int]:
    """LoadAwareDepth.choose as its docstrings define it, each candidate vector priced on its own."""
    import math
    n = len(alphas)
    cost, draft = chooser.cost, chooser.draft_seconds or 0.0
    calls = draft_calls or [True] * n
    rows = (plain_outputs if plain_logits is None else plain_logits) + n
    plain = cost.predict(plain_tokens + n, rows, plain_trees)
    gain = [[expected_tokens(a, k) for k in range(m + 1)] if a >= chooser.min_alpha else [1.0]
            for a, m in zip(alphas, max_depths)]
    ranked = sorted(((a ** k, i) for i, (a, m) in enumerate(zip(alphas, max_depths))
                     if a >= chooser.min_alpha for k in range(1, m + 1)), key=lambda x: -x[0])
    vectors, depths = [], [0] * n
    for _, i in ranked:
        depths[i] += 1
        vectors.append(list(depths))
    vectors += [[min(d, m) if a >= chooser.min_alpha else 0 for a, m in zip(alphas, max_depths)]
                for d in range(1, max(max_depths) + 1)]
    best, best_value = [0] * n, plain * (plain_outputs + n)
    for v in vectors:
        nodes = sum(v)
        t = cost.predict(plain_tokens + n + nodes, rows + nodes, plain_trees + sum(1 for k in v if k)) \
            + (draft if any(k and c for k, c in zip(v, calls)) else 0.0)
        pending = 1.0 if prefill_tokens or waiting else 1.0 - math.exp(-arrival_rate * t)
        gains = [g[k] for g, k in zip(gain, v)]
        slowest = min(gains + ([1.0] if plain_outputs else []))
        if pending * (t - plain) > chooser.ttft_slack * plain or (waiting and t * chooser.margin > plain * slowest) \
                or (full and t > (1 + chooser.tpot_slack) * plain * slowest):
            continue
        value = t * (plain_outputs + sum(1 / g for g in gains))
        if value * (chooser.margin if not any(best) else 1.0001) < best_value:
            best, best_value = v, value
    return best


def test_the_per_step_choice_equals_its_definition_on_random_steps():
    # choose() prices each vector incrementally and stops at the first-token bound (it runs
    # before every step of a load-aware batch); the answer must be the definition's.
    import random
    rng, drafted = random.Random(7), 0
    for case in range(400):
        steep = rng.random() < 0.3  # else memory-bound, where drafting often pays
        chooser = _chooser(a=rng.uniform(0.005, 0.04), b=rng.uniform(0.0, 0.001 if steep else 0.0001),
                           draft_s=rng.uniform(0, 0.004), c=rng.uniform(0.0, 0.0005 if steep else 0.00005),
                           e=rng.uniform(0.0, 0.002 if steep else 0.0002))
        every_row = rng.random() < 0.3  # every row a candidate that may draft: the row gaining least bounds
        n = rng.randint(1, 6 if every_row else 24)
        alphas = [rng.uniform(0.5, 0.95) if every_row else rng.choice([0.01, rng.uniform(0.05, 0.95),
                                                                       rng.uniform(0.6, 0.95)]) for _ in range(n)]
        depths = [rng.randint(1, 8) for _ in range(n)]
        kwargs = dict(prefill_tokens=rng.choice([0, 0, 64]), arrival_rate=rng.choice([0.0, 5.0, 50.0]),
                      waiting=rng.choice([0, 0, 2]), full=rng.random() < 0.3, plain_trees=rng.randint(0, 2),
                      draft_calls=[rng.random() < 0.8 for _ in range(n)])
        plain_outputs = 0 if every_row else rng.choice([0, 0, 3])
        plain_tokens = plain_outputs + kwargs["prefill_tokens"]
        got = chooser.choose(plain_tokens, plain_outputs, alphas, depths, **kwargs)
        assert got == _choose_by_definition(chooser, plain_tokens, plain_outputs, alphas, depths, **kwargs), case
        drafted += any(got)
    assert drafted > 80  # the cases exercise the walk, not only its refusals
