"""A grammar-forced chain's last row, left out of the forward and computed only when the walk
reaches it (structured/vocab_subsets.py, Speculator.accept), on a tiny model, one request at a
time (the single-stream step where that row is the step's one whole row).

The regex forces "#=#=" (characters the tiny tokenizer never merges, so the forced chain is
always accepted whole) and then one free letter: the letter's row is the chain's leaf. Sampled letters have the same distribution with grammar drafts as without
(chi-square); the broken variant, which draws the bonus from the placeholder row instead of the
computed one, fails the same test. Greedy output is identical. (Leaves the walk does not reach,
never computed: tests/target/test_vocab_subsets.py.)"""

from __future__ import annotations

from collections import Counter

import pytest

from specmesh.proto.v1 import common_pb2
from tests.e2e.test_structured_outputs import chi2_bound, chi2_homogeneity
from tests.mesh import collect, request, start_mesh

REGEX = common_pb2.Constraint(regex="#=#=[a-z]")
SAMPLES = 300


async def _letters(model_dir, grammar: bool, temperature: float = 0.15, samples: int = SAMPLES, **sampling):
    speculation = {"speculation_method": "grammar", "speculation_depth": 8} if grammar else None
    mesh = await start_mesh(model_dir, speculation=speculation)
    try:
        out = Counter()
        for seed in range(samples):  # one at a time: the leaf is the step's only whole row
            ids, text, last = await collect(mesh.router_stub, request(
                "Name a letter: a b c", 48, temperature=temperature, seed=seed, has_seed=True,
                constraint=REGEX, **sampling))
            assert text.startswith("#=#=") and last.finish_reason == common_pb2.FINISH_REASON_STOP
            out[text[-1]] += 1
        return out, mesh.engine.runner.lean_forward.output
    finally:
        await mesh.stop()


@pytest.fixture(scope="module")
def plain_letters(tiny_llama_dir):
    import asyncio
    return asyncio.run(_letters(tiny_llama_dir, grammar=False))[0]


async def test_a_deferred_leaf_row_keeps_the_sampled_distribution(tiny_llama_dir, plain_letters):
    letters, output = await _letters(tiny_llama_dir, grammar=True)
    assert output.deferred_rows == output.deferred_computed == SAMPLES  # every letter drawn from its leaf
    stat, df = chi2_homogeneity(plain_letters, letters)
    assert stat < chi2_bound(df), f"chi2 {stat:.1f} >= {chi2_bound(df):.1f} (df {df})"


async def test_a_bonus_drawn_from_the_placeholder_row_fails_the_distribution_check(
        tiny_llama_dir, plain_letters, monkeypatch):
    from services.target.model.model_runner import ModelRunner

    def placeholder(self, row):  # broken: the leaf's logits never computed (zeros: uniform)
        return self.lean_forward.output._deferred[row].new_zeros(self.lean_forward.output.vocab_size).float()
    monkeypatch.setattr(ModelRunner, "deferred_logits", placeholder)
    broken, _ = await _letters(tiny_llama_dir, grammar=True)
    stat, df = chi2_homogeneity(plain_letters, broken)
    assert stat > chi2_bound(df), f"placeholder bonus not detected (chi2 {stat:.1f}, df {df})"


async def test_deferred_leaves_keep_greedy_output(tiny_llama_dir):
    plain, _ = await _letters(tiny_llama_dir, grammar=False, temperature=0.0, samples=1)
    spec, output = await _letters(tiny_llama_dir, grammar=True, temperature=0.0, samples=1)
    assert spec == plain and output.deferred_rows == output.deferred_computed == 1


async def test_a_computed_leaf_row_gets_the_requests_logits_processors(tiny_llama_dir):
    """The leaf row computed after the walk is processed as every verify row is (here a logit
    bias that makes 'q' the greedy letter): drawn from the bare row, the bonus would be the
    model's own favourite ('x')."""
    from services.common.models.tiny import build_tiny_tokenizer
    q = build_tiny_tokenizer().convert_tokens_to_ids("q")
    plain, _ = await _letters(tiny_llama_dir, grammar=False, temperature=0.0, samples=1, logit_bias={q: 20.0})
    spec, output = await _letters(tiny_llama_dir, grammar=True, temperature=0.0, samples=1, logit_bias={q: 20.0})
    assert plain == spec == {"q": 1} and output.deferred_computed == 1
