"""Which logit rows of a step need the output layer only over a few tokens.

Before the forward, every constrained sequence that gets logits this step computes its rows'
masks (`GrammarState.step_masks`, cached: the masking after the forward reuses them). A row
whose mask allows at most `limit` tokens is given to the forward as {row: allowed ids}, and the
output layer multiplies only those tokens' weight rows (services/target/model/output_layer.py).
At a forced position (one allowed token) that is one dot product instead of the whole
vocabulary's; a free position (a string's content) allows most of the vocabulary and stays whole.

Deferred leaves: a grammar-forced draft chain ends where the text is free again (after `"key": "`),
so its last row is whole, and it is needed only if every forced token before it is accepted (it
gives the bonus token then); otherwise the bonus comes from the restricted row where the walk
stopped. Where that leaf row is the step's only whole row (single-stream constrained decoding), it
is given as {row: None}: the forward leaves it out and the speculator computes it only when its
walk ends there (Speculator.accept) — a rejected chain then costs no pass over the vocabulary.
With other whole rows in the step the leaf is computed with them (the packed kernel's cost hardly
grows from one row to three), and several deferred leaves would each cost a pass of their own.
"""

from __future__ import annotations

import torch

# A subset row costs a gather of k weight rows; past 1/64 of the vocabulary (4,096 of the
# default model's 262,144) the packed kernel over every row is the better deal. The bound
# also keeps finding the ids cheap: a free row (most 32-token words of its mask nonzero) is
# turned away by counting words, before any bit is expanded.
SUBSET_SHARE = 1 / 64


def step_vocab_subsets(batch, inputs, trees: dict, vocab_size: int) -> dict[int, torch.Tensor | None]:
    """batch: the step's ScheduledSeqs, inputs: their StepInputs (same order), trees: the draft
    trees that are verified. Returns {global logit row: allowed ids [k] int64, or None: deferred}."""
    limit = max(1, int(vocab_size * SUBSET_SHARE))
    out: dict[int, torch.Tensor | None] = {}
    leaves: list[int] = []  # rows that could be deferred (global)
    row = 0
    for item, inp in zip(batch, inputs):
        grammar = item.seq.grammar
        if grammar is not None and inp.num_logits and not grammar.terminated:
            proposal = trees.get(item.seq.seq_id)
            masks = grammar.step_masks(proposal.token_ids, proposal.parents) if proposal is not None \
                else grammar.step_masks()
            first = row + inp.num_logits - masks.bitmask.shape[0]  # a plain chunk: its last row samples
            masks.restricted.clear()  # this step's forward decides (the masks live until a commit)
            for r in masks.masked:
                ids = masks.allowed_ids(r, limit, vocab_size)
                if ids is not None:
                    out[first + r] = ids
                    masks.restricted.add(r)
            if proposal is not None:
                leaves += [first + r for r in _leaves_behind_restricted(proposal.parents, masks)]
        row += inp.num_logits
    if len(leaves) == 1 and row - len(out) == 1:  # the leaf is the step's one whole row
        out[leaves[0]] = None
    return out


def _leaves_behind_restricted(parents, masks) -> list[int]:
    """The rows (local: 1 + node) of leaf nodes that are masked and whole, whose ancestors' rows
    (the root's included) are all restricted: the walk reaches them only through cheap rows."""
    has_child = set(int(p) for p in parents)
    out = []
    for node, _ in enumerate(parents):
        r = node + 1
        if node in has_child or r not in masks.masked or r in masks.restricted:
            continue
        ancestor, ok = int(parents[node]), 0 in masks.restricted
        while ok and ancestor != -1:
            ok = ancestor + 1 in masks.restricted
            ancestor = int(parents[ancestor])
        if ok:
            out.append(r)
    return out

