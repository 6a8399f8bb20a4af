"""Where the engine meets the grammar: the few calls its step makes, one line each there.

- `masked_sample_rows` (plain sampling, rows that sample a token), `masked_verify_rows` (speculator,
  verify rows of a draft tree; `masked_verify_row` one of them) apply the sequence's mask;
  identity without a constraint.
- `commit_token` (scheduler, per committed token) advances the grammar state.
- `forced_chain` / `grammar_draft` (speculator) propose the forced continuations as draft chains.
- `grammar_pruned` (speculator) drops the draft service's nodes the grammar forbids before the forward.
- `servable_plan` (engine.submit) keeps a speculation plan the target can serve.
"""

from __future__ import annotations

import time

import torch

from services.common.draft_tree import DraftTree
from specmesh.proto.v1 import common_pb2

GRAMMAR = common_pb2.SPECULATION_METHOD_GRAMMAR


def masked_sample_rows(seq, rows: torch.Tensor) -> torch.Tensor:
    """rows: [n, vocab] logits whose last row samples -> the same, masked by the grammar."""
    return rows if seq.grammar is None else seq.grammar.mask_next(rows)


def masked_verify_rows(seq, rows: torch.Tensor, proposal: DraftTree) -> torch.Tensor:
    """rows: [1 + num_nodes, vocab] verify logits -> each row masked along its node's path."""
    if seq.grammar is None:
        return rows
    return seq.grammar.mask_tree(rows, list(proposal.token_ids), list(proposal.parents))


def masked_verify_row(seq, row: torch.Tensor, proposal: DraftTree, r: int) -> torch.Tensor:
    """row: [1, vocab] logits of verify row r -> float32, masked along its node's path as
    `masked_verify_rows` masks it."""
    row = row.float().clone()
    if seq.grammar is not None:
        seq.grammar.mask_row(row, list(proposal.token_ids), list(proposal.parents), r)
    return row


def commit_token(seq, token: int) -> None:
    if seq.grammar is not None:
        seq.grammar.commit(token)


# The prior acceptance of a forced draft token: the grammar allows only the forced text there,
# so the model can refuse only its tokenisation (it seldom does: 0.9 is conservative).
FORCED_PRIOR = 0.9


def forced_chain(seq, limit: int) -> list[int]:
    """Up to `limit` tokens the sequence's grammar forces next ([] without a constraint)."""
    return [] if seq.grammar is None else seq.grammar.forced_tokens(limit)


def grammar_draft(seq, chain: list[int]) -> DraftTree:
    """The forced tokens as the sequence's draft chain (no draft call: its verify pass shows no
    draft time)."""
    now = time.monotonic()
    seq.spec.draft_window = (now, now)
    return DraftTree.chain(seq.seq_id, chain)


def grammar_pruned(seq, tree: DraftTree) -> DraftTree:
    """The draft service's tree without the nodes the grammar forbids (and their subtrees), so
    no row is computed for a token that can never be accepted. Only for deterministic drafts
    (no distributions: q one-hot): there a forbidden token is rejected with certainty and leaves
    the target's distribution as it was, so dropping it changes nothing; a sampled draft's
    rejection leaves the residual max(p - q, 0) instead, which pruning would change."""
    if seq.grammar is None or tree.distributions or not tree.token_ids:
        return tree
    kept = seq.grammar.reachable(list(tree.token_ids), list(tree.parents))
    return tree if len(kept) == len(tree.token_ids) else tree.keep(kept)


def draft_service_method(plan) -> int:
    """The method the draft service runs for a plan's free parts (grammar plans: prompt lookup)."""
    return common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP if plan.method == GRAMMAR else plan.method


def servable_plan(plan, has_grammar: bool, has_draft_service: bool):
    """The plan as the target can serve it: grammar plans need a constraint (else none);
    other methods need a draft service (then constrained ones add grammar drafts)."""
    if plan is None:
        return None
    if plan.method == GRAMMAR:
        return plan if has_grammar else None
    return plan if has_draft_service else None
