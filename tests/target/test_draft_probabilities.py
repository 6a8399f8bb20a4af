"""Real draft probabilities: a sampled request's draft_model chain is drawn from the draft's
own sparse distribution q, sent per node, and the target's rejection sampling uses it.

Real draft and target servers on loopback, the tiny model as both draft and target (so q is
close to the target's p). Shown: (1) the sampled output has the target's distribution
(chi-square homogeneity against the target alone) and a broken draft, which sends q but
drafts its argmax, fails the same test; (2) at T=0.8 on the same seeded drafts, real q
accepts more tokens per verify pass than the same drafts sent without q (one-hot); (3) a
malformed q accepts nothing (the output is the target's own samples), on the wire and in
`Speculator.accept` for each kind of damage.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from services.common.draft_tree import Distribution, DraftTree
from services.common.sampling_params import SamplingConfig
from services.common.server import GrpcServer, ServerConfig
from services.draft.config import DraftConfig
from services.draft.proposers.draft_model import DraftModel, DraftModelProposer
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from services.target.engine.sequence import Sequence
from services.target.kernels.select import get_kernels
from services.target.model.sampler import make_generator
from services.target.speculation.speculator import Speculator
from specmesh.proto.v1 import common_pb2
from tests.e2e.test_structured_outputs import chi2_bound, chi2_homogeneity
from tests.mesh import collect, request, start_mesh

PROMPT, MAX_TOKENS, DEPTH = "Once upon a time", 4, 2  # prefill token + one pass of 2 drafts + bonus
CHI_SAMPLES = 360


class ArgmaxDraftWithRealQ(DraftModelProposer):
    """Broken: sends the sampled q but drafts its most likely token (temperature 0 drafts)."""

    def _sample(self, logits, kv):
        token, distribution = super()._sample(logits, kv)
        return distribution.token_ids[0], distribution


class DraftWithoutQ(DraftModelProposer):
    """The same sampled drafts sent without q: the target treats them as one-hot."""

    def propose_batch(self, states, max_depths, max_nodes):
        return [DraftTree.chain(tree.sequence_id, tree.token_ids)
                for tree in super().propose_batch(states, max_depths, max_nodes)]


class DraftWithNaNQ(DraftModelProposer):
    """Malformed q on the wire: NaN probabilities."""

    def _sample(self, logits, kv):
        token, distribution = super()._sample(logits, kv)
        return token, Distribution(distribution.token_ids, (math.nan,) * len(distribution.probs))


async def _draft_server(model_dir, proposer_class):
    config = DraftConfig(server=ServerConfig(port=0), draft_model_dtype="float32")
    model = DraftModel.load(model_dir, "float32")
    service = DraftService(config, model)
    if proposer_class is not None:
        service.proposers[common_pb2.SPECULATION_METHOD_DRAFT_MODEL] = proposer_class(model)
    server = GrpcServer(config.server, lambda grpc_server: add_to_server(grpc_server, service),
                        [SERVICE_NAME], on_drain=service.drain)
    await server.start()
    return server


async def _sample(model_dir, proposer_class, seeds, max_tokens=MAX_TOKENS, depth=DEPTH, **sampling):
    """[(token ids, usage)] of one sampled request per seed; proposer_class "off" = target alone."""
    draft = None if proposer_class == "off" else await _draft_server(model_dir, proposer_class)
    speculation = None if draft is None else {"speculation_method": "draft_model", "speculation_depth": depth}
    mesh = await start_mesh(model_dir, speculation=speculation, draft_address=draft.address if draft else "",
                            max_batched_tokens=256)
    try:
        out = []
        for start in range(0, len(seeds), 60):  # within the target's queue limit
            results = await asyncio.gather(*(collect(mesh.router_stub, request(
                PROMPT, max_tokens, seed=seed, has_seed=True, **sampling)) for seed in seeds[start:start + 60]))
            out += [(tuple(ids), last.usage) for ids, _, last in results]
        return out
    finally:
        await mesh.stop()
        if draft is not None:
            await draft.stop(grace=0.5)


def _outcomes(samples) -> Counter:
    return Counter(ids for ids, _ in samples)


CHI_SAMPLING = {"temperature": 0.8, "top_k": 2}  # 2**4 outcomes of 4 tokens: every cell well filled


@pytest.fixture(scope="module")
def target_alone(tiny_llama_dir):
    return _outcomes(asyncio.run(_sample(tiny_llama_dir, "off", list(range(CHI_SAMPLES)), **CHI_SAMPLING)))


def test_sampling_with_real_draft_probabilities_follows_the_target(tiny_llama_dir, target_alone):
    samples = asyncio.run(_sample(tiny_llama_dir, None, list(range(10_000, 10_000 + CHI_SAMPLES)), **CHI_SAMPLING))
    assert sum(u.accepted_tokens for _, u in samples) > 0.8 * sum(u.proposed_tokens for _, u in samples)
    stat, df = chi2_homogeneity(target_alone, _outcomes(samples))
    print(f"real q: chi2 {stat:.1f}, df {df}, bound {chi2_bound(df):.1f}")
    assert stat < chi2_bound(df), f"chi2 {stat:.1f} >= {chi2_bound(df):.1f} (df {df})"


def test_argmax_drafts_sent_with_real_q_fail_the_check(tiny_llama_dir, target_alone):
    samples = asyncio.run(_sample(tiny_llama_dir, ArgmaxDraftWithRealQ,
                                  list(range(10_000, 10_000 + CHI_SAMPLES)), **CHI_SAMPLING))
    stat, df = chi2_homogeneity(target_alone, _outcomes(samples))
    print(f"argmax drafts with real q: chi2 {stat:.1f}, df {df}, bound {chi2_bound(df):.1f}")
    assert stat > chi2_bound(df), f"broken draft not detected (chi2 {stat:.1f}, df {df})"


def _accepted_per_pass(samples) -> float:
    return sum(u.accepted_tokens for _, u in samples) / sum(u.verify_passes for _, u in samples)


@pytest.mark.parametrize("top_k", [8, 0])
def test_real_q_accepts_more_per_pass_than_one_hot_on_the_same_drafts(tiny_llama_dir, top_k):
    seeds = list(range(48))
    kwargs = {"max_tokens": 21, "depth": 4, "temperature": 0.8, "top_k": top_k}  # 1 + 4 passes of 5
    real = _accepted_per_pass(asyncio.run(_sample(tiny_llama_dir, None, seeds, **kwargs)))
    one_hot = _accepted_per_pass(asyncio.run(_sample(tiny_llama_dir, DraftWithoutQ, seeds, **kwargs)))
    print(f"top_k {top_k}: accepted per pass of up to 4, real q {real:.2f}, one-hot q {one_hot:.2f}")
    assert real > one_hot
    if top_k:  # q is the target's own top-k distribution: nearly everything is accepted
        assert real > 3.5


def test_malformed_q_on_the_wire_accepts_nothing(tiny_llama_dir):
    samples = asyncio.run(_sample(tiny_llama_dir, DraftWithNaNQ, list(range(16)), max_tokens=8, depth=3,
                                  temperature=0.8, top_k=2))
    assert all(len(ids) == 8 for ids, _ in samples)
    assert sum(u.proposed_tokens for _, u in samples) > 0
    assert sum(u.accepted_tokens for _, u in samples) == 0


def _distributions(kind: str, token: int, vocab: int) -> Distribution:
    good = Distribution((token, (token + 1) % vocab), (0.75, 0.25))
    return {
        "good": good,
        "nan": replace(good, probs=(math.nan, 0.25)),
        "negative": replace(good, probs=(1.25, -0.25)),
        "not summing to 1": replace(good, probs=(0.5, 0.25)),
        "without its token": Distribution(((token + 1) % vocab,), (1.0,)),
        "lengths differ": replace(good, probs=(1.0,)),
        "outside the vocabulary": Distribution((token, vocab), (0.75, 0.25)),
    }[kind]


@pytest.mark.parametrize("kind", ["good", "nan", "negative", "not summing to 1", "without its token",
                                  "lengths differ", "outside the vocabulary"])
def test_malformed_q_makes_the_step_accept_none_of_the_tree(kind):
    vocab = 6
    speculator = Speculator(None, get_kernels("reference"), 64, None)
    rows = torch.full((3, vocab), -30.0)  # [1 + 2 nodes, vocab]: the target follows the draft exactly
    rows[0, 3] = rows[1, 4] = rows[2, 5] = 0.0
    tree = DraftTree.chain("s", [3, 4], [_distributions(kind, 3, vocab), _distributions(kind, 4, vocab)])
    config = SamplingConfig(max_tokens=8, temperature=1.0)
    seq = Sequence("s", [1, 2], config, make_generator(0, "cpu"), None, None)
    path, bonus, _ = speculator.accept(seq, rows, tree)
    if kind == "good":
        assert path == [0, 1] and bonus == 5
    else:
        assert path == [] and bonus == 3  # the root's row, sampled alone
