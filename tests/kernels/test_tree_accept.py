"""Tree acceptance: hand-checked paths, Triton returns exactly the reference's outputs."""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import (
    accept_tree_greedy_reference,
    accept_tree_sampling_reference,
)

from .conftest import DEVICE
from .helpers import binary_tree, chain_tree, random_tree, unbalanced_tree, wide_tree


def _pad(rows: list[list[int]], width: int, fill: int) -> torch.Tensor:
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.int64)


# ------------------------------------------------------------ greedy, by hand

def test_greedy_hand_cases():
    # seq 0: chain root-a-b-c, target agrees on a and b, disagrees at c -> bonus 9.
    # seq 1: wide root with children tokens [5, 7, 7]; target says 7 -> first 7 (node 2).
    # seq 2: root only -> nothing accepted, bonus = argmax at root.
    # seq 3: chain fully accepted -> bonus from the last node's row.
    tokens = _pad([[0, 1, 2, 3], [0, 5, 7, 7], [0], [0, 4, 6]], 4, -1)
    parents = _pad([[-1, 0, 1, 2], [-1, 0, 0, 0], [-1], [-1, 0, 1]], 4, -1)
    num_nodes = torch.tensor([4, 4, 1, 3])
    argmax = _pad([[1, 2, 9, 8], [7, 3, 4, 5], [6], [4, 6, 2]], 4, 0)
    acc, nacc, bonus = accept_tree_greedy_reference(tokens, parents, num_nodes, argmax)
    assert acc.tolist() == [[0, 1, 2, -1], [0, 2, -1, -1], [0, -1, -1, -1], [0, 1, 2, -1]]
    assert nacc.tolist() == [2, 1, 0, 2]
    assert bonus.tolist() == [9, 4, 6, 2]


def test_sampling_hand_cases():
    # vocab 2, p = [0.5, 0.5] at the root, one deterministic child with token 0 (q row = 0).
    # u = 0.3 < p(0) -> accept node 1; its row says token 1 surely -> bonus 1.
    # u = 0.7 -> reject; residual = normalize(max(p - onehot(0), 0)) = [0, 1] -> bonus 1.
    tokens = torch.tensor([[0, 0], [0, 0]])
    parents = torch.tensor([[-1, 0], [-1, 0]])
    num_nodes = torch.tensor([2, 2])
    target = torch.tensor([[[0.5, 0.5], [0.0, 1.0]]] * 2)
    draft = torch.zeros(2, 2, 2)
    uniforms = torch.tensor([[0.0, 0.3, 0.01], [0.0, 0.7, 0.01]])
    acc, nacc, bonus = accept_tree_sampling_reference(tokens, parents, num_nodes, target, draft, uniforms)
    assert acc.tolist() == [[0, 1], [0, -1]] and nacc.tolist() == [1, 0] and bonus.tolist() == [1, 1]


def test_sampling_ratio_test_uses_q():
    # Sampled child with q(x) = 0.8, p(x) = 0.4 -> accept iff u < 0.5.
    tokens = torch.tensor([[0, 2]] * 2)
    parents = torch.tensor([[-1, 0]] * 2)
    target = torch.tensor([[[0.3, 0.3, 0.4], [1.0, 0.0, 0.0]]] * 2)
    draft = torch.tensor([[[0.1, 0.1, 0.8], [1.0, 0.0, 0.0]]] * 2)
    uniforms = torch.tensor([[0.0, 0.49, 0.75], [0.0, 0.51, 0.75]])
    acc, nacc, bonus = accept_tree_sampling_reference(tokens, parents, torch.tensor([2, 2]), target, draft, uniforms)
    assert nacc.tolist() == [1, 0]
    # Accepted: node 1's row is one-hot on token 0. Rejected: residual max(p - q, 0) =
    # [0.2, 0.2, 0]; the bonus uniform 0.75 of its mass 0.4 is 0.3 -> token 1 (never 2).
    assert bonus.tolist() == [0, 1]


# ------------------------------------------------------------ random batches

SHAPES = [chain_tree, wide_tree, binary_tree, unbalanced_tree]


def _random_batch(seed: int, S: int, max_nodes: int, vocab: int, device: str):
    """Trees of all shapes, ragged num_nodes, garbage in padded entries."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (S, max_nodes), generator=g)
    parents = torch.randint(-5, max_nodes, (S, max_nodes), generator=g)  # garbage past num_nodes
    num_nodes = torch.randint(1, max_nodes + 1, (S,), generator=g)
    for s in range(S):
        n = int(num_nodes[s])
        shape = SHAPES[s % len(SHAPES)](n) if s % 5 != 4 else random_tree(n, g)
        parents[s, :n] = torch.tensor(shape)
    # Target peaked on the drafted tokens half of the time, so paths get long.
    logits = torch.randn((S, max_nodes, vocab), generator=g)
    follow = torch.rand((S, max_nodes), generator=g) < 0.6
    nxt = tokens.roll(-1, dims=1)  # node n's likely child is n + 1 in chains
    logits.scatter_add_(2, nxt[..., None], torch.where(follow, 6.0, 0.0)[..., None])
    target = torch.softmax(logits, -1)
    draft = torch.softmax(logits + torch.randn((S, max_nodes, vocab), generator=g), -1)
    deterministic = torch.rand((S, max_nodes), generator=g) < 0.3
    draft[deterministic] = 0.0  # deterministic proposals (q row of zeros)
    uniforms = torch.rand((S, max_nodes + 1), generator=g)
    argmax = target.argmax(-1)
    to = lambda t: t.to(device)  # noqa: E731
    return dict(
        draft_tokens=to(tokens), parents=to(parents.int() if seed % 2 else parents), num_nodes=to(num_nodes),
        target_probs=to(target), draft_probs=to(draft), uniforms=to(uniforms), target_argmax=to(argmax),
    )


def _assert_same(a, b):
    for name, x, y in zip(("accepted_nodes", "num_accepted", "bonus_token"), a, b):
        assert x.dtype == torch.int64 and y.dtype == torch.int64, name
        assert torch.equal(x.cpu(), y.cpu()), f"{name}: {x.tolist()} != {y.tolist()}"


@pytest.mark.triton
@pytest.mark.parametrize("seed,S,max_nodes", [(0, 16, 9), (1, 8, 1), (2, 12, 17), (3, 5, 4)])
def test_triton_greedy_equals_reference(triton_kernels, seed, S, max_nodes):
    b = _random_batch(seed, S, max_nodes, 6, DEVICE)
    args = (b["draft_tokens"], b["parents"], b["num_nodes"], b["target_argmax"])
    ref = accept_tree_greedy_reference(*(t.cpu() for t in args))
    tri = triton_kernels.accept_tree_greedy(*args)
    _assert_same(ref, tri)
    assert max_nodes == 1 or ref[1].max() >= (2 if max_nodes >= 9 else 1)  # multi-node paths occur


@pytest.mark.triton
@pytest.mark.parametrize(
    "seed,S,max_nodes,vocab",
    [(10, 16, 9, 8), (11, 6, 1, 5), (12, 10, 13, 40), (13, 4, 6, 1500)],  # 1500 > one BLOCK_V chunk
)
def test_triton_sampling_equals_reference(triton_kernels, seed, S, max_nodes, vocab):
    b = _random_batch(seed, S, max_nodes, vocab, DEVICE)
    args = (b["draft_tokens"], b["parents"], b["num_nodes"], b["target_probs"], b["draft_probs"], b["uniforms"])
    ref = accept_tree_sampling_reference(*(t.cpu() for t in args))
    tri = triton_kernels.accept_tree_sampling(*args)
    _assert_same(ref, tri)
    if max_nodes > 1:
        assert ref[1].max() >= 1 and (ref[1] == 0).any()  # both acceptances and rejections
