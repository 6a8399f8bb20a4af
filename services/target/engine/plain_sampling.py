"""One new token for each sequence that samples plainly this step (it checked no draft tree):
its row masked by its grammar, then logits processing, sampling and log-probabilities for
all of them in one call (services/target/model/sample_rows.py), and its confidence.

A leader whose prefill ends this step samples its followers' first tokens from the same
row, each with its own generator (services/target/engine/samples.py).
"""

from __future__ import annotations

import torch

from services.target.engine.scheduler import ScheduledSeq, StepResult
from services.target.model.sample_rows import sample_rows
from services.target.structured.hooks import masked_sample_rows


def sample_plain(batch: list[ScheduledSeq], rows: list[torch.Tensor], trees: dict,
                 ) -> tuple[dict[str, StepResult], dict[str, Exception]]:
    """rows[i]: [num_logits, vocab] logits of batch[i]; sequences in `trees` are the
    speculator's. Returns (StepResult per sampled sequence, error per sequence whose sampling
    failed: that request fails alone)."""
    plain, plain_rows = [], []
    for item, item_rows in zip(batch, rows):
        if item.seq.seq_id in trees or not item.samples:
            continue
        for sampled_item in (item, *followers_of(item)):  # followers: the same row
            plain.append(sampled_item)
            plain_rows.append(masked_sample_rows(sampled_item.seq, item_rows))
    if not plain:
        return {}, {}
    seqs = [item.seq for item in plain]
    sampled, logprobs = sample_rows(stacked(plain_rows), [s.sampling for s in seqs], [s.generator for s in seqs],
                                    [s.logits_processor for s in seqs], [s.token_ids for s in seqs])
    results, failed = {}, {}
    for seq, seq_rows, token, logprob in zip(seqs, plain_rows, sampled, logprobs):
        if isinstance(token, Exception):
            failed[seq.seq_id] = token
            continue
        results[seq.seq_id] = StepResult([token], logprobs=None if logprob is None else [logprob])
        if seq.confidence is not None:
            seq.confidence.add(seq_rows[-1:], [token])
    return results, failed


def stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """rows ([n_i, vocab] each) as one [sum n_i, vocab] tensor: a view where they already lie back
    to back in one tensor (a step's plain rows, split from its logits in order), else a copy.
    At 18 decode rows of a 262k vocabulary the copy moved 9 MB a step; sampling never writes
    into its input (logits processing and the sampler's cleaning work on copies)."""
    first = rows[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for r in rows:
        if (not r.is_contiguous() or r.dtype != first.dtype or r.shape[1:] != first.shape[1:]
                or r.untyped_storage().data_ptr() != storage or r.storage_offset() != offset):
            return torch.cat(rows)
        offset += r.numel()
    if len(rows) == 1:
        return first
    return first.as_strided((sum(r.shape[0] for r in rows), *first.shape[1:]), first.stride(), first.storage_offset())


def followers_of(item: ScheduledSeq) -> list[ScheduledSeq]:
    """The samples waiting on `item`'s prefill, sampled from its row (services/target/engine/samples.py)."""
    return [ScheduledSeq(f, item.start, item.num_tokens) for f in item.seq.followers]
