"""Draft LM forwards over several sequences at once, each on its own cached prefix.

`BatchedForward` copies the sequences' KV caches once into one right-padded batch cache
(per layer [batch, kv_heads, width, head_dim], `width` the longest cached prefix; a row's
columns past its own prefix are padding no query sees). Every `feed` then appends one block
of columns for all rows in one forward: row i's new tokens (padded to the block's longest
row), each attending its row's whole cached prefix plus the tokens this batch fed for that
row that `sees` allows (a chain: all earlier ones; a tree: its ancestors), under the draft
model's sliding windows where it has them. Padded queries see only themselves.

A row's cache is not touched until `write_back`, which appends the KV of the chosen fed
tokens (e.g. the committed ones, never a tree's scratch) to it. DynamicLayer.update copies
a layer's whole cache on every forward anyway, so the gather costs about one more such copy
per proposal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


class BatchedForward:
    def __init__(self, draft, caches: Sequence[DynamicCache]) -> None:
        """`draft`: a DraftModel; `caches`: one per row, each holding its tokens from position 0."""
        self.draft = draft
        self.lengths = [cache.get_seq_length() for cache in caches]  # [batch] cached prefix per row
        self.width = max(self.lengths)
        batch = len(caches)
        data = []
        if self.width:
            for layer in range(len(caches[self.lengths.index(self.width)].layers)):
                like = caches[self.lengths.index(self.width)].layers[layer].keys  # [1, kv_heads, width, head_dim]
                k = like.new_zeros(batch, like.shape[1], self.width, like.shape[3])
                v = torch.zeros_like(k)
                for row, (cache, length) in enumerate(zip(caches, self.lengths)):
                    if length:
                        k[row, :, :length] = cache.layers[layer].keys[0]
                        v[row, :, :length] = cache.layers[layer].values[0]
                data.append((k, v))
        self.cache = DynamicCache(data or None)
        # [batch, width]: the row's own cached prefix (every new token of the row attends it)
        self._prefix = torch.arange(self.width)[None] < torch.tensor(self.lengths)[:, None]
        self._key_pos = torch.arange(self.width).expand(batch, -1)  # [batch, columns]: each column's position
        self._slots: list[list[int]] = [[] for _ in caches]  # per row: the column of each token fed here
        self._windows = _layer_windows(draft.config)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def num_fed(self, row: int) -> int:
        return len(self._slots[row])

    @torch.inference_mode()
    def feed(self, tokens: Sequence[Sequence[int]], positions: Sequence[Sequence[int]],
             sees: Sequence[torch.Tensor | None], logit_rows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One forward for all rows. Row i feeds `tokens[i]` (may be empty) at `positions[i]`;
        `sees[i]`: bool [m_i, fed_i + m_i] over the row's tokens fed so far then the new ones
        (None = causal: all earlier ones and itself). Returns per row the logits of its new
        tokens at `logit_rows[i]` ([len(logit_rows[i]), vocab] float32)."""
        batch, device = self.batch_size, self.draft.device
        block = max(len(t) for t in tokens)
        start = self.cache.get_seq_length()  # columns before this block
        ids = torch.zeros(batch, block, dtype=torch.long)  # [batch, block]
        pos = torch.zeros(batch, block, dtype=torch.long)  # [batch, block]
        allowed = torch.zeros(batch, block, start + block, dtype=torch.bool)  # [batch, queries, keys]
        allowed[:, :, :self.width] = self._prefix[:, None, :]
        for row in range(batch):
            m = len(tokens[row])
            if len(positions[row]) != m:
                raise ValueError(f"row {row}: {m} tokens but {len(positions[row])} positions")
            ids[row, :m] = torch.tensor(list(tokens[row]), dtype=torch.long)
            pos[row, :m] = torch.tensor(list(positions[row]), dtype=torch.long)
            pos[row, m:] = pos[row, m - 1] if m else 0
            columns = self._slots[row] + [start + j for j in range(m)]
            view = sees[row] if sees[row] is not None else torch.ones(m, len(columns), dtype=torch.bool).tril(
                len(columns) - m)
            if tuple(view.shape) != (m, len(columns)):
                raise ValueError(f"row {row}: sees has shape {tuple(view.shape)}, want ({m}, {len(columns)})")
            if m:
                allowed[row, :m, columns] = view.cpu()
            allowed[row, torch.arange(m, block), start + torch.arange(m, block)] = True  # padding sees itself
        key_pos = torch.cat([self._key_pos, pos], dim=1)  # [batch, keys]
        masks = {kind: _additive(allowed if window is None else
                                 allowed & (key_pos[:, None, :] > pos[:, :, None] - window),
                                 self.draft.dtype, device)
                 for kind, window in self._windows.items()}
        wanted = sorted({j for rows in logit_rows for j in rows})
        out = self.draft.model(input_ids=ids.to(device), position_ids=pos.to(device), cache=self.cache,
                               use_cache=True, attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
                               logits_to_keep=torch.tensor(wanted or [0], device=device))
        logits = out.logits.float()  # [batch, len(wanted), vocab]
        self._key_pos = key_pos
        for row in range(batch):
            self._slots[row] += [start + j for j in range(len(tokens[row]))]
        index = {j: n for n, j in enumerate(wanted)}
        return [logits[row, [index[j] for j in rows]] for row, rows in enumerate(logit_rows)]

    def write_back(self, row: int, cache: DynamicCache, slots: Sequence[int]) -> None:
        """Appends the KV of the row's fed tokens `slots` (indices in feeding order) to `cache`."""
        if not slots:
            return
        columns = torch.tensor([self._slots[row][s] for s in slots], device=self.draft.device)
        for layer, batch_layer in enumerate(self.cache.layers):
            cache.update(batch_layer.keys[row:row + 1, :, columns], batch_layer.values[row:row + 1, :, columns],
                         layer)


def _layer_windows(config) -> dict[str, int | None]:
    """Sliding window per attention layer type; one entry ("all") when all layers agree."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types and "sliding_attention" in layer_types and window:
        windows: dict[str, int | None] = {"full_attention": None, "sliding_attention": int(window)}
        return {kind: windows[kind] for kind in dict.fromkeys(layer_types)}
    if not layer_types and window and getattr(config, "use_sliding_window", True):
        return {"all": int(window)}  # e.g. Mistral: every layer slides
    return {"all": None}


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[batch, q, k] bool -> [batch, 1, q, k] additive mask (0 where allowed, dtype min elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None].to(device)
