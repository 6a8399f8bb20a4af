"""Penalties, bias and min_tokens: the processor equals a per-row reference written from the
definitions (every row its own history), and speculation with them stays lossless.

The statistical test: a Markov "target model" (raw logits L[previous token]) over a vocab of
4; each trial generates 3 tokens after a 2-token prompt with every penalty, a bias and
min_tokens on, by the engine's real code: Speculator.accept over a draft chain or tree
(deterministic proposals: the raw greedy chain, siblings distinct) and sample_rows for plain
steps. The joint of the 3 tokens (64 cells, pooled where the expectation is below 5) is
compared by Pearson's chi-square with the exact joint computed from the reference, and the
same for plain sampling without speculation. Bound: the 1e-6 upper quantile (fixed seeds,
so deterministic). A broken variant that penalizes every verify row by the committed tokens
only (ignoring the draft tokens of its own path) must fail by far.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from services.common.sampling_params import SamplingConfig
from services.target.kernels.select import get_kernels
from services.target.model.logits_processors import LogitsProcessor, tree_paths
from services.target.model.sample_rows import sample_rows
from services.target.model.sampler import make_generator
from services.target.engine.sequence import Sequence
from services.target.speculation import speculator as speculator_module
from services.target.speculation.speculator import Speculator
from services.common.draft_tree import DraftTree
from tests.kernels.test_tree_accept_stats import chi2_bound

VOCAB, EOS, PROMPT, LENGTH, TRIALS = 4, 2, [0, 1], 3, 6000
L = torch.tensor([[1.0, 0.6, 0.2, -0.4], [0.1, 1.2, -0.5, 0.4],
                  [0.3, -0.2, 0.9, 0.5], [0.8, 0.2, 0.1, 0.6]])  # raw logits after each token
CONFIG = SamplingConfig(max_tokens=LENGTH, temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6,
                        repetition_penalty=1.7, logit_bias=((3, 0.4),), min_tokens=2)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny tensor ops: one thread (an OpenMP team only waits on a shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_logits(raw: torch.Tensor, history: list[int], num_prompt: int, config: SamplingConfig,
                     eos: set[int]) -> torch.Tensor:
    """raw: [vocab] -> the logits sampled from, straight from the definitions (float64)."""
    x = raw.double().clone()
    for token, bias in config.logit_bias:
        x[token] += bias
    output = history[num_prompt:]
    if len(output) < config.min_tokens:
        for token in eos:
            x[token] = float("-inf")
    rp = config.repetition_penalty or 1.0
    for token in set(history):
        x[token] = x[token] / rp if x[token] > 0 else x[token] * rp
    for token, count in Counter(output).items():
        x[token] -= config.frequency_penalty * count + config.presence_penalty
    return x


def test_processor_rows_equal_the_reference_along_each_path():
    gen = torch.Generator().manual_seed(0)
    vocab, prompt = 12, [1, 2, 3, 3]
    config = SamplingConfig(max_tokens=20, presence_penalty=0.5, frequency_penalty=-0.3,
                            repetition_penalty=1.4, logit_bias=((4, 2.0), (7, -1.5)), min_tokens=4)
    processor = LogitsProcessor(config, frozenset({0, 5}), len(prompt))
    history = [*prompt, 4, 7, 4]  # three generated tokens
    tree = DraftTree.from_nodes("s", [4, 9, 3, 4], [-1, 0, 0, 1])  # root -> 4 -> {9 -> 4, 3}
    paths = tree_paths(tree.token_ids, tree.parents)
    assert paths == [(), (4,), (4, 9), (4, 3), (4, 9, 4)]
    raw = torch.randn(len(paths), vocab, generator=gen) * 3  # [rows, vocab]
    for step in range(2):  # the second call catches up with a committed token
        got = processor.apply(raw, history, paths)
        for i, path in enumerate(paths):
            want = reference_logits(raw[i], history + list(path), len(prompt), config, {0, 5})
            assert torch.allclose(got[i].double(), want, atol=1e-5), (step, i)
        history.append(9)
    assert LogitsProcessor.for_request(SamplingConfig(max_tokens=4), frozenset({0}), 3) is None


def exact_joint(config: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(y1, y2, y3) of sequential sampling from the reference logits (temperature 1)."""
    joint = {}
    for ys in itertools.product(range(VOCAB), repeat=LENGTH):
        history, p = list(PROMPT), 1.0
        for y in ys:
            probs = torch.softmax(reference_logits(L[history[-1]], history, len(PROMPT), config, {EOS}), 0)
            p *= float(probs[y])
            history.append(y)
        joint[ys] = p
    return joint


def generate(config: SamplingConfig, shape: str | None, seed: int) -> list[tuple[int, ...]]:
    """TRIALS samples of LENGTH tokens: speculative passes over `shape` ("chain" or "tree"),
    or plain sampling when None, through the engine's own sampling code."""
    speculator = Speculator(None, get_kernels("reference"), 64, None)
    out = []
    for trial in range(TRIALS):
        seq = Sequence(f"t{trial}", list(PROMPT), config, make_generator(seed * 100003 + trial, "cpu"), None, None,
                       logits_processor=LogitsProcessor.for_request(config, frozenset({EOS}), len(PROMPT)))
        while seq.num_output_tokens < LENGTH:
            remaining = LENGTH - seq.num_output_tokens
            if shape is None or remaining == 1:
                tokens, _ = sample_rows(L[seq.token_ids[-1]][None], [config], [seq.generator],
                                        [seq.logits_processor], [seq.token_ids])
                seq.token_ids.append(tokens[0])
                continue
            tree = _draft(seq.token_ids[-1], shape, remaining - 1)
            rows = L[[seq.token_ids[-1], *tree.token_ids]]  # [1 + nodes, vocab]: row after each node
            path, bonus, _ = speculator.accept(seq, rows, tree)
            seq.token_ids.extend([*(tree.token_ids[n] for n in path), bonus][:remaining])
        out.append(tuple(seq.token_ids[len(PROMPT):]))
    return out


def _draft(last: int, shape: str, depth: int) -> DraftTree:
    """The raw model's greedy chain (a plausible draft), or a tree with distinct siblings."""
    chain, token = [], last
    for _ in range(depth):
        token = int(L[token].argmax())
        chain.append(token)
    if shape == "chain" or depth < 2:
        return DraftTree.chain("s", chain)
    second = (chain[0] + 1) % VOCAB
    return DraftTree.from_nodes("s", [chain[0], second, chain[1], (chain[1] + 2) % VOCAB],
                                [-1, -1, 0, 0])


def chi2(samples: list[tuple[int, ...]], joint: dict) -> tuple[float, int]:
    """(Pearson statistic, degrees of freedom), cells with expectation < 5 pooled into one."""
    observed = Counter(samples)
    n = len(samples)
    stat, cells, pooled_o, pooled_e = 0.0, 0, 0, 0.0
    for ys, p in joint.items():
        e = p * n
        if e < 5:
            pooled_o, pooled_e = pooled_o + observed.get(ys, 0), pooled_e + e
            continue
        stat += (observed.get(ys, 0) - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return stat, cells - 1


@pytest.mark.parametrize("shape", [None, "chain", "tree"])
def test_penalized_sampling_follows_the_target_with_and_without_speculation(shape):
    stat, df = chi2(generate(CONFIG, shape, seed=1), exact_joint(CONFIG))
    assert stat < chi2_bound(df), f"chi2 {stat:.1f} >= {chi2_bound(df):.1f} (df {df}, shape {shape})"


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_path_blind_penalties_fail_the_check(shape, monkeypatch):
    # The broken variant: every verify row penalized by the committed tokens only.
    monkeypatch.setattr(speculator_module, "tree_paths", lambda tokens, parents: [()] * (len(tokens) + 1))
    stat, df = chi2(generate(CONFIG, shape, seed=1), exact_joint(CONFIG))
    assert stat > 5 * chi2_bound(df), f"path-blind penalties not detected (chi2 {stat:.1f}, df {df})"
