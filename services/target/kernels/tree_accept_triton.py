"""Tree acceptance, Triton version (same signatures and results as tree_accept.py, whose
docstring defines the tree convention, outputs and the sampling math).

One program per sequence walks its tree. Node tensors of a sequence fit in registers
(NODES_PAD lanes); the sampling residual lives in a float64 scratch row [S, vocab] in
global memory and is only touched (in BLOCK_V chunks) when a child is rejected and when
the bonus token is drawn. Branching on runtime values is written as masks and loop
bounds that shrink to zero, so the control flow stays simple for the compiler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._validate import check_tensor
from .tree_accept import validate_sampling_args, validate_tree_args


def accept_tree_greedy_triton(
    draft_tokens: torch.Tensor,  # [S, max_nodes] int64
    parents: torch.Tensor,  # [S, max_nodes] int32/int64
    num_nodes: torch.Tensor,  # [S] int32/int64
    target_argmax: torch.Tensor,  # [S, max_nodes] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance: longest root path whose tokens equal the target's argmax."""
    S, max_nodes = validate_tree_args(draft_tokens, parents, num_nodes)
    check_tensor("target_argmax", target_argmax, [S, max_nodes], (torch.int64,), draft_tokens.device, "[S, max_nodes]")
    acc, nacc, bonus = _empty_outputs(S, max_nodes, draft_tokens.device)
    if S > 0:
        _accept_greedy_kernel[(S,)](
            acc, nacc, bonus, draft_tokens, parents, num_nodes, target_argmax,
            MAX_NODES=max_nodes, NODES_PAD=triton.next_power_of_2(max_nodes),
        )
    return acc, nacc, bonus


def accept_tree_sampling_triton(
    draft_tokens: torch.Tensor,  # [S, max_nodes] int64
    parents: torch.Tensor,  # [S, max_nodes] int32/int64
    num_nodes: torch.Tensor,  # [S] int32/int64
    target_probs: torch.Tensor,  # [S, max_nodes, vocab] f32
    draft_probs: torch.Tensor,  # [S, max_nodes, vocab] f32, row n = q of n's children
    uniforms: torch.Tensor,  # [S, max_nodes + 1] f32 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless rejection-sampling acceptance over the tree."""
    S, max_nodes = validate_sampling_args(draft_tokens, parents, num_nodes, target_probs, draft_probs, uniforms)
    vocab = target_probs.shape[2]
    acc, nacc, bonus = _empty_outputs(S, max_nodes, draft_tokens.device)
    if S > 0:
        residual = torch.empty((S, vocab), dtype=torch.float64, device=draft_tokens.device)  # [S, vocab]
        _accept_sampling_kernel[(S,)](
            acc, nacc, bonus, residual, draft_tokens, parents, num_nodes,
            target_probs, draft_probs, uniforms, vocab,
            MAX_NODES=max_nodes, NODES_PAD=triton.next_power_of_2(max_nodes),
            BLOCK_V=min(1024, triton.next_power_of_2(max(vocab, 16))),
        )
    return acc, nacc, bonus


def _empty_outputs(S: int, max_nodes: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = torch.empty((S, max_nodes), dtype=torch.int64, device=device)  # [S, max_nodes]
    nacc = torch.empty(S, dtype=torch.int64, device=device)  # [S]
    bonus = torch.empty(S, dtype=torch.int64, device=device)  # [S]
    return acc, nacc, bonus


@triton.jit
def _accept_greedy_kernel(
    acc_ptr,  # [S, MAX_NODES] i64 out: accepted path, -1 padded
    nacc_ptr,  # [S] i64 out
    bonus_ptr,  # [S] i64 out
    draft_tokens_ptr,  # [S, MAX_NODES] i64
    parents_ptr,  # [S, MAX_NODES] i32/i64
    num_nodes_ptr,  # [S] i32/i64
    target_argmax_ptr,  # [S, MAX_NODES] i64
    MAX_NODES: tl.constexpr,
    NODES_PAD: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    n = tl.load(num_nodes_ptr + s).to(tl.int32)
    offs = tl.arange(0, NODES_PAD)  # [NODES_PAD]
    in_row = offs < MAX_NODES
    row = s * MAX_NODES
    par = tl.load(parents_ptr + row + offs, mask=in_row, other=-2).to(tl.int32)  # [NODES_PAD]
    tok = tl.load(draft_tokens_ptr + row + offs, mask=in_row, other=-1)  # [NODES_PAD]
    path = tl.where(offs == 0, 0, -1).to(tl.int64)  # [NODES_PAD]
    cur = tl.zeros([], tl.int32)
    alive = tl.full([], 1, tl.int1)
    depth = tl.zeros([], tl.int64)
    bonus = tl.zeros([], tl.int64)
    for d in range(1, MAX_NODES + 1):  # <= MAX_NODES - 1 accepts, then the bonus
        t = tl.load(target_argmax_ptr + row + cur)
        is_child = (par == cur) & (offs > cur) & (offs < n) & (tok == t)
        c = tl.min(tl.where(is_child, offs, NODES_PAD), axis=0)
        found = alive & (c < NODES_PAD)
        path = tl.where(found & (offs == d), c.to(tl.int64), path)
        depth += found.to(tl.int64)
        bonus = tl.where(alive & (c >= NODES_PAD), t, bonus)
        cur = tl.where(found, c, cur)
        alive = found
    tl.store(acc_ptr + row + offs, path, mask=in_row)
    tl.store(nacc_ptr + s, depth)
    tl.store(bonus_ptr + s, bonus)


@triton.jit
def _accept_sampling_kernel(
    acc_ptr,  # [S, MAX_NODES] i64 out: accepted path, -1 padded
    nacc_ptr,  # [S] i64 out
    bonus_ptr,  # [S] i64 out
    residual_ptr,  # [S, vocab] f64 scratch
    draft_tokens_ptr,  # [S, MAX_NODES] i64
    parents_ptr,  # [S, MAX_NODES] i32/i64
    num_nodes_ptr,  # [S] i32/i64
    target_probs_ptr,  # [S, MAX_NODES, vocab] f32
    draft_probs_ptr,  # [S, MAX_NODES, vocab] f32
    uniforms_ptr,  # [S, MAX_NODES + 1] f32
    vocab,  # i32
    MAX_NODES: tl.constexpr,
    NODES_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    n = tl.load(num_nodes_ptr + s).to(tl.int32)
    offs = tl.arange(0, NODES_PAD)  # [NODES_PAD]
    offs_v = tl.arange(0, BLOCK_V)  # [BLOCK_V]
    row = s * MAX_NODES
    r_row = residual_ptr + s * vocab  # [vocab] f64
    path = tl.where(offs == 0, 0, -1).to(tl.int64)  # [NODES_PAD]
    cur = tl.zeros([], tl.int32)
    alive = tl.full([], 1, tl.int1)
    depth = tl.zeros([], tl.int64)
    bonus = tl.zeros([], tl.int64)
    # residual <- target_probs[s, 0]
    mass = _load_row(r_row, target_probs_ptr + row * vocab, vocab, vocab, BLOCK_V)
    for d in range(1, MAX_NODES + 1):  # <= MAX_NODES - 1 accepts, then the bonus
        q_row = draft_probs_ptr + (row + cur) * vocab  # [vocab] q of cur's children
        moved = tl.zeros([], tl.int1)
        nxt = cur
        for c in range(1, MAX_NODES):
            p_c = tl.load(parents_ptr + row + c).to(tl.int32)
            trying = alive & (moved == 0) & (p_c == cur) & (c > cur) & (c < n)
            x = tl.load(draft_tokens_ptr + row + c)
            qx = tl.load(q_row + x, mask=trying, other=1.0).to(tl.float64)
            det = qx <= 0.0  # deterministic proposal: q = one-hot(x)
            qx = tl.where(det, 1.0, qx)
            u = tl.load(uniforms_ptr + s * (MAX_NODES + 1) + c).to(tl.float64)
            rx = tl.load(r_row + x, mask=trying, other=0.0)
            ok = trying & (u * qx * mass < rx)
            moved = moved | ok
            nxt = tl.where(ok, c, nxt)
            # Rejected: r <- max(r - mass * q, 0) unless that leaves no mass.
            span = tl.where(trying & (ok == 0), vocab, 0)
            new_mass = tl.zeros([], tl.float64)
            for v0 in range(0, span, BLOCK_V):
                new_r, _ = _residual_chunk(r_row, q_row, v0 + offs_v, vocab, x, det, mass)
                new_mass += tl.sum(new_r, axis=0)
            span = tl.where(new_mass > 0.0, span, 0)
            for v0 in range(0, span, BLOCK_V):
                new_r, in_v = _residual_chunk(r_row, q_row, v0 + offs_v, vocab, x, det, mass)
                tl.store(r_row + v0 + offs_v, new_r, mask=in_v)
            mass = tl.where(span > 0, new_mass, mass)
        # Accepted a child: continue from it with its target row.
        step = alive & moved
        path = tl.where(step & (offs == d), nxt.to(tl.int64), path)
        depth += step.to(tl.int64)
        cur = tl.where(step, nxt, cur)
        span = tl.where(step, vocab, 0)
        new_mass = _load_row(r_row, target_probs_ptr + (row + cur) * vocab, vocab, span, BLOCK_V)
        mass = tl.where(step, new_mass, mass)
        # No child accepted: draw the bonus token from the residual.
        stop = alive & (moved == 0)
        u_b = tl.load(uniforms_ptr + s * (MAX_NODES + 1) + MAX_NODES).to(tl.float64)
        tok = _inverse_cdf(r_row, vocab, tl.where(stop, vocab, 0), u_b * mass, BLOCK_V)
        bonus = tl.where(stop, tok, bonus)
        alive = step
    tl.store(acc_ptr + row + offs, path, mask=offs < MAX_NODES)
    tl.store(nacc_ptr + s, depth)
    tl.store(bonus_ptr + s, bonus)


@triton.jit
def _load_row(r_row, src_row, vocab, span, BLOCK_V: tl.constexpr):
    """residual[:span] <- src[:span] (f32 -> f64); returns the sum (0 if span == 0)."""
    offs_v = tl.arange(0, BLOCK_V)
    total = tl.zeros([], tl.float64)
    for v0 in range(0, span, BLOCK_V):
        in_v = v0 + offs_v < vocab
        p = tl.load(src_row + v0 + offs_v, mask=in_v, other=0.0).to(tl.float64)
        tl.store(r_row + v0 + offs_v, p, mask=in_v)
        total += tl.sum(p, axis=0)
    return total


@triton.jit
def _residual_chunk(r_row, q_row, v, vocab, x, det, mass):
    """One chunk of max(r - mass * q, 0) over vocab indices v; q = one-hot(x) when det."""
    in_v = v < vocab
    r = tl.load(r_row + v, mask=in_v, other=0.0)
    q = tl.load(q_row + v, mask=in_v, other=0.0).to(tl.float64)
    q = tl.where(det, tl.where(v == x, 1.0, 0.0).to(tl.float64), q)
    return tl.maximum(r - mass * q, 0.0), in_v


@triton.jit
def _inverse_cdf(r_row, vocab, span, target, BLOCK_V: tl.constexpr):
    """First v with r[v] > 0 and cumsum(r)[v] > target; else the last v with r[v] > 0."""
    offs_v = tl.arange(0, BLOCK_V)
    running = tl.zeros([], tl.float64)
    first = tl.full([], -1, tl.int64)
    last = tl.full([], 0, tl.int64)
    for v0 in range(0, span, BLOCK_V):
        v = v0 + offs_v
        r = tl.load(r_row + v, mask=v < vocab, other=0.0)  # [BLOCK_V] f64
        cdf = tl.cumsum(r, axis=0) + running
        hit = (cdf > target) & (r > 0.0)
        cand = tl.min(tl.where(hit, v, 2147483647), axis=0).to(tl.int64)
        first = tl.where((first < 0) & (cand < 2147483647), cand, first)
        last = tl.maximum(last, tl.max(tl.where(r > 0.0, v, 0), axis=0).to(tl.int64))
        running += tl.sum(r, axis=0)
    return tl.where(first >= 0, first, last)
