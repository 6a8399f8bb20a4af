"""The accuracy cost of a weight format, measured against the unquantized model.

Teacher-forced: both models read the same token sequences (the reference model's own greedy
continuations), and at every position we compare
  * greedy agreement: the two argmax tokens are equal;
  * log-probability gap: log p_ref(t) - log p_test(t) for the reference's greedy token t
    (how much probability the quantized model takes away from the reference's choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    positions: int
    greedy_agreement: float  # fraction of positions whose argmax tokens are equal
    mean_logprob_gap: float  # mean over positions of log p_ref(t) - log p_test(t), t = reference argmax


@torch.inference_mode()
def greedy_agreement(reference, test, sequences: list[list[int]], skip: int = 0) -> Agreement:
    """sequences: token ids read by both models; positions before `skip` (the prompt) are not scored."""
    agree, gap, count = 0, 0.0, 0
    for ids in sequences:
        x = torch.tensor([ids])
        ref = torch.log_softmax(reference(input_ids=x).logits[0, skip:].float(), -1)  # [n, vocab]
        out = torch.log_softmax(test(input_ids=x).logits[0, skip:].float(), -1)
        choice = ref.argmax(-1)  # [n]
        agree += int((out.argmax(-1) == choice).sum())
        gap += float((ref.gather(1, choice[:, None]) - out.gather(1, choice[:, None])).sum())
        count += len(choice)
    return Agreement(count, agree / count, gap / count)
