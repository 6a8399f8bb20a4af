"""Which logit rows of a step nothing reads but a greedy argmax: those the output layer may
compute through its argmax screen (services/target/model/output_layer.py; the screen itself:
services/target/kernels/argmax_screen.py), exact at the tokens that can win and -inf elsewhere.

A row qualifies when its sequence samples greedily this step (no samples of an n > 1 request
drawn from the same row) and no one reads its distribution: no log-probabilities, no penalties or
bias (a logits processor that only masks, min_tokens, is fine: its banned tokens go with the
marker, and a row whose screened argmax is one of them is computed whole), no grammar mask and no
confidence sums. That holds for a plain decode row and for every row of a greedy draft tree's
verify pass alike: greedy acceptance reads each node's argmax and nothing else
(Speculator.accept), so a depth-4 chain's five rows take the screen too. Anything else keeps its
whole row.
"""

from __future__ import annotations

from services.target.engine.scheduler import ScheduledSeq
from services.target.model.output_layer import ARGMAX_ONLY, ArgmaxOnly


def argmax_rows(batch: list[ScheduledSeq], inputs: list, trees: dict) -> dict[int, ArgmaxOnly]:
    """{logit row: ArgmaxOnly marker} for the step's rows whose only reader is the greedy argmax;
    inputs[i] is batch[i]'s StepInput (its num_logits rows follow the previous inputs': one for a
    plain row, root + draft nodes for a sequence verifying its tree in `trees`)."""
    rows, offset = {}, 0
    for item, inp in zip(batch, inputs):
        seq = item.seq
        banned = () if seq.logits_processor is None else seq.logits_processor.masks_only
        if ((inp.num_logits == 1 or seq.seq_id in trees) and item.samples and not seq.followers
                and seq.sampling.greedy and not seq.sampling.logprobs and not seq.sampling.top_logprobs
                and banned is not None and seq.grammar is None and seq.confidence is None):
            marker = ArgmaxOnly(banned) if banned else ARGMAX_ONLY
            rows.update(dict.fromkeys(range(offset, offset + inp.num_logits), marker))
        offset += inp.num_logits
    return rows
