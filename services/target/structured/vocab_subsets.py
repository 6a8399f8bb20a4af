"""Which logit rows of a step need the output layer only over a few tokens.

Before the forward, every constrained sequence that gets logits this step computes its rows'
masks (`GrammarState.step_masks`, cached: the masking after the forward reuses them). A row
whose mask allows at most `limit` tokens is given to the forward as {row: allowed ids}, and the
output layer multiplies only those tokens' weight rows (services/target/model/output_layer.py).
At a forced position (one allowed token) that is one dot product instead of the whole
vocabulary's; a free position (a string's content) allows most of the vocabulary and stays whole.
"""

from __future__ import annotations

import torch

# A subset row costs a gather of k weight rows; past 1/64 of the vocabulary (4,096 of the
# default model's 262,144) the packed kernel over every row is the better deal. The bound
# also keeps finding the ids cheap: a free row (most 32-token words of its mask nonzero) is
# turned away by counting words, before any bit is expanded.
SUBSET_SHARE = 1 / 64


def step_vocab_subsets(batch, inputs, trees: dict, vocab_size: int) -> dict[int, torch.Tensor]:
    """batch: the step's ScheduledSeqs, inputs: their StepInputs (same order), trees: the draft
    trees that are verified. Returns {global logit row: allowed ids [k] int64}."""
    limit = max(1, int(vocab_size * SUBSET_SHARE))
    out: dict[int, torch.Tensor] = {}
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
        row += inp.num_logits
    return out
