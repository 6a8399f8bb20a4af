"""Tree acceptance: walk each sequence's draft tree against the target (PyTorch reference).

Tree convention (the words of docs/speculation.md): node 0 is the root, the last committed
token, whose target distribution is computed in the same verify pass; nodes
1 .. num_nodes-1 are draft tokens; parents[s, n] < n is node n's parent
(parents[s, 0] = -1); target row n is the target's distribution for the token that
FOLLOWS node n. Outputs, for every sequence s:
  accepted_nodes [S, max_nodes] int64  node indices of the accepted path, root first,
                                       padded with -1 (max_nodes = max_depth + 1 of the
                                       deepest possible tree, a chain)
  num_accepted   [S] int64             accepted draft nodes (root excluded)
  bonus_token    [S] int64             the target's token after the accepted path

Greedy: from cur = root, t = target_argmax[cur]; the first child c (index order) with
draft_tokens[c] == t is accepted and the walk continues from c; otherwise bonus = t.

Sampling (lossless recursive rejection, SpecInfer / vLLM style). At node cur the
residual starts as p = target_probs[cur]. Each child c of cur (index order) carries
token x = draft_tokens[c] proposed from q = draft_probs[cur] (row n holds the draft
distribution the children of n were sampled from). If q(x) == 0 the child cannot have
been sampled from q, so it is treated as a deterministic proposal, q = one-hot(x)
(n-gram / prompt-lookup proposers may pass one-hot or all-zero rows).
  accept c with probability min(1, p(x) / q(x))            (uniforms[s, c])
  on rejection p <- normalize(max(p - q, 0)), try the next child
  no child accepted: bonus ~ p by inverse CDF              (uniforms[s, max_nodes])
Why it is exact: if x ~ q, then P(accept, x = y) = q(y) min(1, p(y)/q(y)) = min(p(y), q(y))
and P(reject) = 1 - sum_y min(p, q) = sum_y max(p - q, 0) =: Z, so
P(output y) = min(p(y), q(y)) + Z * max(p(y) - q(y), 0) / Z = p(y). For several children
apply this to each in turn: conditioned on the previous rejections, the next child's
token is still distributed as q (children of one node are independent draws from q,
or deterministic), so by induction the token emitted at cur follows the residual
at the first child, i.e. target_probs[cur]; the accepted child then continues the same
argument one level deeper with the target's distribution at that child. Chains are the
one-child case. A deterministic proposal (q = one-hot(x)) is exact for ANY token x,
however it was chosen, as long as the choice does not depend on the uniforms: accept
with p(x), else continue with p restricted to y != x; so a zero draft row is always
lossless, only the acceptance rate is lower than with the true q. Children drawn
WITHOUT replacement from one q (e.g. distinct top-k tokens of a draft LM) are not
independent draws from q: pass zero rows for them, not q.
Numerics: the residual is kept unnormalized in float64 with its mass m, and
"u < (r(x)/m) / q(x)" is evaluated as "u * q(x) * m < r(x)". A rejection that would
leave zero residual mass (probability zero in exact arithmetic) leaves p unchanged.
"""

from __future__ import annotations

import torch

from ._validate import INDEX_DTYPES, check_tensor


def accept_tree_greedy_reference(
    draft_tokens: torch.Tensor,  # [S, max_nodes] int64 (node 0 = root token, unused)
    parents: torch.Tensor,  # [S, max_nodes] int32/int64, parents[s, 0] = -1
    num_nodes: torch.Tensor,  # [S] int32/int64, nodes incl. root
    target_argmax: torch.Tensor,  # [S, max_nodes] int64, target's token after node n
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance: longest root path whose tokens equal the target's argmax."""
    S, max_nodes = validate_tree_args(draft_tokens, parents, num_nodes)
    check_tensor("target_argmax", target_argmax, [S, max_nodes], (torch.int64,), draft_tokens.device, "[S, max_nodes]")
    acc, nacc, bonus = _new_outputs(S, max_nodes, draft_tokens.device)
    tok, par, n_nodes, argmax = draft_tokens.tolist(), parents.tolist(), num_nodes.tolist(), target_argmax.tolist()
    for s in range(S):
        cur, depth = 0, 0
        while True:
            t = argmax[s][cur]
            nxt = next((c for c in range(cur + 1, n_nodes[s]) if par[s][c] == cur and tok[s][c] == t), -1)
            if nxt < 0:
                bonus[s] = t
                break
            cur, depth = nxt, depth + 1
            acc[s, depth] = cur
        nacc[s] = depth
    return acc, nacc, bonus


def accept_tree_sampling_reference(
    draft_tokens: torch.Tensor,  # [S, max_nodes] int64
    parents: torch.Tensor,  # [S, max_nodes] int32/int64
    num_nodes: torch.Tensor,  # [S] int32/int64
    target_probs: torch.Tensor,  # [S, max_nodes, vocab] f32, target distribution after node n
    draft_probs: torch.Tensor,  # [S, max_nodes, vocab] f32, row n = q of n's children
    uniforms: torch.Tensor,  # [S, max_nodes + 1] f32 in [0, 1); column c tests node c, last = bonus
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless rejection-sampling acceptance over the tree (see module docstring)."""
    S, max_nodes = validate_sampling_args(draft_tokens, parents, num_nodes, target_probs, draft_probs, uniforms)
    acc, nacc, bonus = _new_outputs(S, max_nodes, draft_tokens.device)
    tok, par, n_nodes = draft_tokens.tolist(), parents.tolist(), num_nodes.tolist()
    u = uniforms.double()  # [S, max_nodes + 1]
    for s in range(S):
        cur, depth = 0, 0
        while True:
            # The residual r [vocab] f64 (unnormalized) is copied out of target_probs only once a
            # child is rejected: a node accepted at once reads one entry and the row's sum.
            base = target_probs[s, cur]  # [vocab] f32
            r, mass = None, base.sum(dtype=torch.float64)
            nxt = -1
            for c in range(cur + 1, n_nodes[s]):
                if par[s][c] != cur:
                    continue
                x = tok[s][c]
                rx = float(base[x]) if r is None else float(r[x])
                if float(draft_probs[s, cur, x]) <= 0:  # deterministic proposal: q = one-hot(x)
                    if u[s, c] * mass < rx:
                        nxt = c
                        break
                    if r is None:
                        r = base.double()
                    r[x] = max(rx - float(mass), 0.0)  # max(p - q, 0) touches x alone
                    new_mass = r.sum()
                    if new_mass > 0:
                        mass = new_mass
                    else:  # no mass would remain: p unchanged
                        r[x] = rx
                    continue
                q = draft_probs[s, cur].double()  # [vocab]
                if r is None:
                    r = base.double()
                if u[s, c] * q[x] * mass < r[x]:
                    nxt = c
                    break
                r, mass = _residual_after_rejection(r, mass, q)
            if nxt < 0:
                bonus[s] = sample_inverse_cdf(base.double() if r is None else r, u[s, max_nodes] * mass)
                break
            cur, depth = nxt, depth + 1
            acc[s, depth] = cur
        nacc[s] = depth
    return acc, nacc, bonus


def _residual_after_rejection(
    r: torch.Tensor,  # [vocab] f64 unnormalized residual
    mass: torch.Tensor,  # [] f64, r.sum()
    q: torch.Tensor,  # [vocab] f64 draft distribution of the rejected child
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(p - q, 0) with p = r / mass, kept unnormalized; unchanged if no mass would remain."""
    new_r = (r - mass * q).clamp(min=0.0)
    new_mass = new_r.sum()
    return (new_r, new_mass) if new_mass > 0 else (r, mass)


def sample_inverse_cdf(r: torch.Tensor, target: torch.Tensor | float) -> int:
    """First v with r[v] > 0 and cumsum(r)[v] > target; the last v with r[v] > 0 if none."""
    cdf = torch.cumsum(r, 0)  # [vocab]
    hit = ((cdf > target) & (r > 0)).nonzero()
    if hit.numel() > 0:
        return int(hit[0, 0])
    pos = (r > 0).nonzero()
    return int(pos[-1, 0]) if pos.numel() > 0 else 0


def _new_outputs(S: int, max_nodes: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = torch.full((S, max_nodes), -1, dtype=torch.int64, device=device)  # [S, max_nodes]
    if max_nodes > 0:
        acc[:, 0] = 0
    nacc = torch.zeros(S, dtype=torch.int64, device=device)  # [S]
    bonus = torch.zeros(S, dtype=torch.int64, device=device)  # [S]
    return acc, nacc, bonus


def validate_tree_args(draft_tokens, parents, num_nodes) -> tuple[int, int]:
    """Shared checks for the tree tensors. Returns (S, max_nodes)."""
    check_tensor("draft_tokens", draft_tokens, [None, None], (torch.int64,), None, "[S, max_nodes]")
    S, max_nodes = draft_tokens.shape
    if max_nodes < 1:
        raise ValueError("draft_tokens must have max_nodes >= 1 (the root) columns: [S, max_nodes]")
    dev = draft_tokens.device
    check_tensor("parents", parents, [S, max_nodes], INDEX_DTYPES, dev, f"[S={S}, max_nodes={max_nodes}]")
    check_tensor("num_nodes", num_nodes, [S], INDEX_DTYPES, dev, f"[S={S}]")
    return S, max_nodes


def validate_sampling_args(draft_tokens, parents, num_nodes, target_probs, draft_probs, uniforms) -> tuple[int, int]:
    """Shared checks for the sampling variant. Returns (S, max_nodes)."""
    S, max_nodes = validate_tree_args(draft_tokens, parents, num_nodes)
    dev = draft_tokens.device
    check_tensor("target_probs", target_probs, [S, max_nodes, None], (torch.float32,), dev, f"[S={S}, max_nodes={max_nodes}, vocab]")
    vocab = target_probs.shape[2]
    doc = f"[S={S}, max_nodes={max_nodes}, vocab={vocab}]"
    check_tensor("draft_probs", draft_probs, [S, max_nodes, vocab], (torch.float32,), dev, doc)
    check_tensor("uniforms", uniforms, [S, max_nodes + 1], (torch.float32,), dev, f"[S={S}, max_nodes + 1={max_nodes + 1}]")
    return S, max_nodes
