"""Draft model: a small local Hugging Face causal LM proposes its continuation.

`DraftModel` wraps the loaded LM (shared by the DRAFT_MODEL and DYNAMIC_TREE proposers);
`DraftModelProposer` keeps one KV cache per sequence (`transformers.DynamicCache`) and
proposes a chain of min(max_depth, max_nodes) tokens: its greedy chain for a greedy
request, and for a sampled one a chain sampled from its own distribution at the request's
temperature, top_k and top_p, truncated to its `max_top_k` most likely tokens and
renormalised (`sparse_distribution`). Each node's token is drawn from exactly the sparse
distribution sent with it (DraftTree.distributions), which is what makes the target's
rejection sampling with it lossless.

KV cache of a sequence (`SequenceKV`): KV for `token_ids`, which are always a prefix of
the committed tokens followed by draft tokens the cache ran ahead with. Rollback:
- `observe` compares the newly committed tokens with the cached ones at the same
  positions and crops the cache to the common prefix (a rejected draft token and all
  after it are dropped; accepted ones are kept);
- `propose` first feeds the committed tokens the cache lacks (at least the last one,
  for its logits), so the cache holds exactly the committed tokens, then drafts.
After a chain of k tokens the cache holds the committed tokens plus the first k - 1
draft tokens (the last one was never fed). The prefix is never recomputed.

The draft model must share the target's tokenizer; this is not checked here. Token ids
must be below the draft model's vocabulary size (`vocab_size`); the service checks.
All sequences of one `propose_batch` draft together: one forward per depth for all of them
(`BatchedForward`: their caches padded into one batch; each keeps its own cache, appended
with what it committed and drafted). A prompt's tokens beyond the last `BATCHED_FEED` are
prefilled alone first, in chunks of `prefill_chunk` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from services.common.draft_tree import Distribution
from services.draft.proposers.base import DraftSampling, DraftTree, Proposer
from services.draft.proposers.batched_forward import BatchedForward
from services.draft.state import SequenceState

BATCHED_FEED = 16  # committed tokens a sequence feeds in the batched forward; more (a prompt) are prefilled alone
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DraftModel:
    """A loaded draft LM (prefills one sequence's KV cache; batched forwards: BatchedForward)."""

    def __init__(self, model: PreTrainedModel, prefill_chunk: int = 512) -> None:
        self.model = model.eval()
        self.prefill_chunk = prefill_chunk
        self.config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @classmethod
    def load(cls, model_dir: Path, dtype: str = "bfloat16", device: str = "cpu",
             prefill_chunk: int = 512) -> DraftModel:
        from services.common.models.loading import load_causal_lm
        model, _ = load_causal_lm(Path(model_dir), DTYPES[dtype], device)
        return cls(model, prefill_chunk)

    @torch.inference_mode()
    def extend(self, cache: DynamicCache, token_ids: Sequence[int]) -> torch.Tensor:
        """Feeds `token_ids` after the cached tokens (causal); returns the logits after
        the last one."""  # -> [vocab] float32
        start = cache.get_seq_length()
        logits = None
        for begin in range(0, len(token_ids), self.prefill_chunk):
            chunk = list(token_ids[begin:begin + self.prefill_chunk])
            ids = torch.tensor([chunk], dtype=torch.long, device=self.device)  # [1, chunk]
            positions = torch.arange(start + begin, start + begin + len(chunk), device=self.device)[None]
            out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                             logits_to_keep=1)
            logits = out.logits[0, -1]
        assert logits is not None, "extend needs at least one token"
        return logits.float()


@dataclass
class SequenceKV:
    """The draft model's KV cache of one sequence."""

    cache: DynamicCache = field(default_factory=DynamicCache)
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is cached
    num_committed: int = 0  # committed tokens observed
    sampling: DraftSampling = DraftSampling()
    generator: torch.Generator | None = None  # the draft's own sampler, made on the first sampled request

    def crop(self, length: int) -> None:
        """Keeps the KV of the first `length` cached tokens."""
        drop = len(self.token_ids) - length
        if drop > 0:
            self.cache.crop(-drop)
            del self.token_ids[length:]


def sparse_distribution(logits: torch.Tensor, sampling: DraftSampling,
                        max_top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [vocab] float32 -> (token ids [k] int64, probs [k] float32 summing to 1):
    softmax(logits / temperature) over its top min(max_top_k, top_k) tokens, then the
    smallest top_p nucleus of those, renormalised. Most likely first."""
    k = min(max_top_k, sampling.top_k) if sampling.top_k > 0 else max_top_k
    values, ids = torch.topk(logits / sampling.temperature, min(k, logits.shape[-1]))  # [k] descending
    probs = torch.softmax(values, dim=-1)  # [k]
    if 0.0 < sampling.top_p < 1.0:
        keep = int((torch.cumsum(probs, 0) - probs < sampling.top_p).sum())  # at least the first
        ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
    return ids, probs


class DraftModelProposer(Proposer):
    def __init__(self, draft: DraftModel, max_top_k: int = 16) -> None:
        """`max_top_k`: the most tokens of a sampled node's distribution sent (and sampled from)."""
        self.draft = draft
        self.max_top_k = max_top_k
        self.vocab_size = draft.vocab_size
        self._kv: dict[str, SequenceKV] = {}

    def propose(self, states: Sequence[SequenceState], max_depth: int, max_nodes: int) -> list[DraftTree]:
        return self.propose_batch(states, [max_depth] * len(states), [max_nodes] * len(states))

    def propose_batch(self, states: Sequence[SequenceState], max_depths: Sequence[int],
                      max_nodes: Sequence[int]) -> list[DraftTree]:
        """Every chain of the batch in one draft forward per depth (BatchedForward)."""
        lengths = [min(depth, nodes) for depth, nodes in zip(_checked(max_depths), _checked(max_nodes), strict=True)]
        if len(lengths) != len(states):
            raise ValueError(f"{len(states)} states but {len(lengths)} max_depths and max_nodes")
        if not states:
            return []
        kvs, feeds = zip(*(self._prepare(state) for state in states))
        batch = BatchedForward(self.draft, [kv.cache for kv in kvs])
        starts = [len(kv.token_ids) for kv in kvs]  # position of each row's first fed token
        logits = batch.feed(feeds, [range(start, start + len(feed)) for start, feed in zip(starts, feeds)],
                            [None] * len(kvs), [[len(feed) - 1] for feed in feeds])
        chains: list[list[int]] = [[] for _ in states]
        distributions: list[list[Distribution]] = [[] for _ in states]
        for step in range(max(lengths)):
            for i, kv in enumerate(kvs):
                if step < lengths[i]:
                    self._pick(logits[i][-1], kv, chains[i], distributions[i])
            if step + 1 < max(lengths):  # feed each row's newest draft token while its chain goes on
                tokens = [chain[-1:] if step + 1 < n else [] for chain, n in zip(chains, lengths)]
                positions = [[start + len(feed) + step] * len(t) for start, feed, t in zip(starts, feeds, tokens)]
                logits = batch.feed(tokens, positions, [None] * len(kvs), [[0] if t else [] for t in tokens])
        for i, kv in enumerate(kvs):  # the cache keeps the committed tokens and all but the last draft
            batch.write_back(i, kv.cache, range(batch.num_fed(i)))
            kv.token_ids.extend(list(feeds[i]) + chains[i][:lengths[i] - 1])
        return [DraftTree.chain(state.sequence_id, chain, dists)
                for state, chain, dists in zip(states, chains, distributions)]

    def observe(self, sequence_id: str, new_token_ids: Sequence[int]) -> None:
        kv = self._kv.get(sequence_id)
        if kv is None:
            kv = self._kv[sequence_id] = SequenceKV()
        start = kv.num_committed
        common = 0
        ahead = kv.token_ids[start:start + len(new_token_ids)]
        while common < len(ahead) and ahead[common] == new_token_ids[common]:
            common += 1
        kv.crop(start + common)  # drops the first rejected draft token and all after it
        kv.num_committed += len(new_token_ids)

    def set_sampling(self, sequence_id: str, sampling: DraftSampling) -> None:
        kv = self._kv.setdefault(sequence_id, SequenceKV())
        kv.sampling = sampling
        if not sampling.greedy and kv.generator is None:
            kv.generator = sampling.generator(self.draft.device)

    def release(self, sequence_id: str) -> None:
        self._kv.pop(sequence_id, None)

    def cached_token_ids(self, sequence_id: str) -> tuple[int, ...]:
        """The tokens whose KV the sequence's cache holds (empty when unknown)."""
        kv = self._kv.get(sequence_id)
        return () if kv is None else tuple(kv.token_ids)

    def cache_length(self, sequence_id: str) -> int:
        """Tokens in the sequence's KV cache as transformers sees it (0 when unknown)."""
        kv = self._kv.get(sequence_id)
        return 0 if kv is None else kv.cache.get_seq_length()

    # ---- helpers ------------------------------------------------------------------------

    def _prepare(self, state: SequenceState) -> tuple[SequenceKV, list[int]]:
        """Crops the cache to the committed tokens it holds (at most all but the last one, whose
        logits are needed) and prefills alone all but the last `BATCHED_FEED` committed tokens it
        lacks (a prompt); returns the cache and the committed tokens still to feed (at least one)."""
        kv = self._kv.get(state.sequence_id)
        if kv is None or kv.num_committed != state.num_tokens:
            seen = 0 if kv is None else kv.num_committed
            raise RuntimeError(f"draft model cache of {state.sequence_id!r} has seen {seen} committed "
                               f"tokens, history has {state.num_tokens}: observe() was skipped")
        keep = min(len(kv.token_ids), state.num_tokens - 1)
        kv.crop(keep)
        missing = state.token_ids[keep:].tolist()
        alone = missing[:-BATCHED_FEED]
        if alone:
            self.draft.extend(kv.cache, alone)
            kv.token_ids.extend(alone)
        return kv, missing[len(alone):]

    def _pick(self, logits: torch.Tensor, kv: SequenceKV, chain: list[int],
              distributions: list[Distribution]) -> None:
        """Appends the next draft token of logits [vocab]: argmax, or drawn from the sparse q sent with it."""
        if kv.sampling.greedy:
            chain.append(int(torch.argmax(logits)))  # first maximum: ties go to the lowest id
            return
        token, distribution = self._sample(logits, kv)
        chain.append(token)
        distributions.append(distribution)

    def _sample(self, logits: torch.Tensor, kv: SequenceKV) -> tuple[int, Distribution]:
        """A token drawn from the sparse distribution it is sent with."""  # logits: [vocab] float32
        ids, probs = sparse_distribution(logits, kv.sampling, self.max_top_k)  # [k], [k]
        pick = int(torch.multinomial(probs, 1, generator=kv.generator))
        return int(ids[pick]), Distribution(tuple(ids.tolist()), tuple(probs.tolist()))


def _checked(limits: Sequence[int]) -> Sequence[int]:
    if any(limit < 1 for limit in limits):
        raise ValueError(f"max_depth and max_nodes must be >= 1, got {list(limits)}")
    return limits

