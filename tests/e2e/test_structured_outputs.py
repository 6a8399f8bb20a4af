"""Constrained generation through router -> target, with and without speculation.

Three meshes on the same tiny model: no speculation; grammar drafts only (the router's
`structured` bucket plans SPECULATION_METHOD_GRAMMAR, no draft service); grammar drafts
plus prompt lookup from a real draft service for the free parts (whose drafts the grammar
often forbids). Every output satisfies its constraint, greedy output is token-identical
across the three, and the sampled distribution is the same with and without speculation
(chi-square), while force-injecting the grammar's drafts — the shortcut that skips
verification — is detected by the same test.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from specmesh.proto.v1 import common_pb2
from tests.mesh import collect, request, start_draft, start_mesh
from tests.structured import CONSTRAINTS, valid

PROMPTS = ['Answer as JSON like {"name": "bo", "active": true, "kind": "beta"} red apple (1+2)',
           "Once upon a time"]
BOUNDED = [k for k in CONSTRAINTS if k != "json_object"]  # always complete within max_tokens


async def _generate(mesh, kinds, temperature, seeds=(0,), max_tokens=64):
    """{(kind, prompt index, seed): (token ids, text, final chunk)}."""
    keys = [(k, p, s) for k in kinds for p in range(len(PROMPTS)) for s in seeds]
    results = await asyncio.gather(*(collect(mesh.router_stub, request(
        PROMPTS[p], max_tokens, temperature=temperature, seed=s, has_seed=True,
        constraint=CONSTRAINTS[k])) for k, p, s in keys))
    return dict(zip(keys, results))


async def _with_mesh(model_dir, mode, fn):
    draft = await start_draft() if mode == "prompt_lookup" else None
    speculation = {"off": None, "grammar": {"speculation_method": "grammar", "speculation_depth": 8},
                   "prompt_lookup": {"speculation_method": "prompt_lookup", "speculation_depth": 8}}[mode]
    mesh = await start_mesh(model_dir, speculation=speculation,
                            draft_address=draft.address if draft else "", max_batched_tokens=256)
    try:
        return await fn(mesh)
    finally:
        await mesh.stop()
        if draft is not None:
            await draft.stop(grace=0.5)


async def test_every_constraint_kind_validates_and_greedy_is_identical_with_speculation(tiny_llama_dir):
    kinds = list(CONSTRAINTS)
    runs = {}
    for mode in ("off", "grammar", "prompt_lookup"):
        async def both(mesh):
            return (await _generate(mesh, kinds, 0.0),
                    await _generate(mesh, kinds, 0.9, seeds=(1, 2, 3)))
        runs[mode] = await _with_mesh(tiny_llama_dir, mode, both)
    for mode, (greedy, sampled) in runs.items():
        for (kind, p, seed), (ids, text, last) in {**greedy, **sampled}.items():
            if kind in BOUNDED:
                assert last.finish_reason == common_pb2.FINISH_REASON_STOP, (mode, kind, text)
            if last.finish_reason == common_pb2.FINISH_REASON_STOP:
                assert valid(kind, text), (mode, kind, p, seed, text)
            else:  # json_object on a random model may not close in time: never `stop`
                assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert len(ids) == 64
    plain = runs["off"][0]
    for mode in ("grammar", "prompt_lookup"):
        greedy = runs[mode][0]
        for key, (ids, text, _) in plain.items():
            assert greedy[key][0] == ids, (mode, key, text, greedy[key][1])
        usage = [last.usage for _, _, last in greedy.values()]
        assert sum(u.accepted_tokens for u in usage) > 0, mode
    # Drafts the grammar forbids (prompt lookup copies the prompt) were verified and rejected.
    usage = [last.usage for _, _, last in {**runs["prompt_lookup"][0], **runs["prompt_lookup"][1]}.values()]
    assert sum(u.rejected_tokens for u in usage) > 0


async def test_grammar_that_cannot_complete_within_max_tokens_ends_with_length(tiny_llama_dir):
    async def short(mesh):
        return await _generate(mesh, ["json_schema"], 0.0, max_tokens=6)
    for mode in ("off", "grammar"):
        for ids, text, last in (await _with_mesh(tiny_llama_dir, mode, short)).values():
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, (mode, text)
            assert len(ids) == 6


# ---- the sampled distribution ------------------------------------------------------------

CHI_CHOICES = ["the quick brown fox", "a lazy dog"]  # many tokenisations of forced text
CHI_SAMPLES = 240


async def _sample_outcomes(model_dir, mode) -> Counter:
    constraint = common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=CHI_CHOICES))

    async def run(mesh):
        out = Counter()
        for start in range(0, CHI_SAMPLES, 60):  # within the target's queue limit
            results = await asyncio.gather(*(collect(mesh.router_stub, request(
                "Pick one:", 32, temperature=1.0, seed=seed, has_seed=True, constraint=constraint))
                for seed in range(start, start + 60)))
            for ids, text, last in results:
                assert text in CHI_CHOICES and last.finish_reason == common_pb2.FINISH_REASON_STOP
                out[tuple(ids)] += 1  # the token sequence: tokenisations differ in probability
        return out
    return await _with_mesh(model_dir, mode, run)


def chi2_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's chi-square of two samples over the same outcomes (rare ones pooled);
    returns (statistic, degrees of freedom)."""
    na, nb = sum(a.values()), sum(b.values())
    cells, rare_a, rare_b = [], 0, 0
    for key in set(a) | set(b):
        if a[key] + b[key] < 10:
            rare_a, rare_b = rare_a + a[key], rare_b + b[key]
        else:
            cells.append((a[key], b[key]))
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


def chi2_bound(df: int, z: float = 4.753) -> float:
    """Upper quantile of chi-square(df) at standard-normal z (Wilson-Hilferty); z=4.753 ~ 1e-6."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.fixture(scope="module")
def plain_outcomes(tiny_llama_dir):
    return asyncio.run(_sample_outcomes(tiny_llama_dir, "off"))


async def test_constrained_sampling_has_the_same_distribution_with_grammar_speculation(
        tiny_llama_dir, plain_outcomes):
    spec = await _sample_outcomes(tiny_llama_dir, "grammar")
    stat, df = chi2_homogeneity(plain_outcomes, spec)
    assert df >= 2, "too few distinct outcomes to test anything"
    assert stat < chi2_bound(df), f"chi2 {stat:.1f} >= {chi2_bound(df):.1f} (df {df})"


async def test_force_injected_grammar_drafts_fail_the_distribution_check(
        tiny_llama_dir, plain_outcomes, monkeypatch):
    """The broken variant: grammar drafts committed without verification (each draft row made
    one-hot on its draft token) keep every output valid but skew the distribution."""
    from services.target.speculation import speculator
    masked = speculator.masked_verify_rows

    def force_inject(seq, rows, proposal):
        rows = masked(seq, rows, proposal).clone()
        for i, (token, parent) in enumerate(zip(proposal.token_ids, proposal.parents)):
            rows[parent + 1] = float("-inf")
            rows[parent + 1, token] = 0.0
        return rows
    monkeypatch.setattr(speculator, "masked_verify_rows", force_inject)
    broken = await _sample_outcomes(tiny_llama_dir, "grammar")
    stat, df = chi2_homogeneity(plain_outcomes, broken)
    assert stat > chi2_bound(df), f"force-injected drafts not detected (chi2 {stat:.1f}, df {df})"
