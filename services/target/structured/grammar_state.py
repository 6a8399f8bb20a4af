"""One sequence's grammar state: the only owner of its xgrammar matcher.

The matcher holds the committed output's parse state. It is advanced by committed tokens
only (`commit`, called where tokens are appended: services/target/engine/scheduler.py);
everything else reads it or explores from it and returns it as it was:
- `mask_next(logits)`: the mask of the token after the committed output (a row that samples);
- `mask_tree(rows, parents, tokens)`: the verify rows of a draft tree, each masked with the
  state along its own node's path (accept the node's token, recurse, roll back);
- `forced_tokens(limit)`: the tokens the grammar forces next (grammar drafts).

A step's masks are computed once, before the forward (`step_masks`, cached until the next
commit): the forward then needs logits only over the tokens a row allows where that set is
small (services/target/structured/vocab_subsets.py), and the masking after it reuses them.

Masking sets forbidden logits to -inf, so any later softmax renormalises over the allowed
tokens; stop tokens are allowed only where the grammar accepts the output so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from services.target.structured.utf8_guard import Utf8Guard


class GrammarViolation(RuntimeError):
    """A token the grammar forbids reached commit (a bug upstream; fails that request only)."""


@dataclass(frozen=True)
class RowMasks:
    """The masks of one step's logit rows of a sequence: row 0 follows the committed output,
    row 1 + i follows draft node i (a plain row: row 0 only)."""

    bitmask: torch.Tensor  # [1 + num_nodes, ceil(vocab / 32)] int32, xgrammar's layout
    masked: tuple[int, ...]  # the rows that are masked (unreachable and terminated rows are not)
    prev_tokens: tuple[int | None, ...]  # per row, the token it follows (the UTF-8 guard's context)
    # Rows whose logits the output layer computed over exactly their allowed ids (-inf
    # elsewhere), set by the step that did so (vocab_subsets.py): `apply` skips their bitmask.
    restricted: set[int] = field(default_factory=set)

    def allowed_ids(self, row: int, limit: int, vocab_size: int) -> torch.Tensor | None:
        """The token ids row `row` allows ([k] int64, ascending), or None if it is not masked or
        allows more than `limit` (each nonzero 32-bit word allows at least one: checked first)."""
        if row not in self.masked:
            return None
        words = self.bitmask[row]  # [num_words] int32
        nonzero = words.nonzero().flatten()  # [w]
        if nonzero.numel() > limit:
            return None
        bits = (words[nonzero].unsqueeze(1) >> _BIT_SHIFTS) & 1  # [w, 32]
        ids = (nonzero.unsqueeze(1) * 32 + _BIT_SHIFTS)[bits.bool()]  # ascending
        ids = ids[ids < vocab_size]
        return ids if ids.numel() <= limit else None


_BIT_SHIFTS = torch.arange(32, dtype=torch.int64)


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, utf8_guard: Utf8Guard | None = None,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)  # unlimited rollback: trees roll back freely
        self.vocab_size = vocab_size
        self.utf8_guard = utf8_guard  # no surrogate bytes in the output (utf8_guard.py)
        self.encode = encode  # text -> the model tokenizer's ids (forced drafts' tokenisation)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self.num_committed = 0
        self.last_token: int | None = None  # the last committed token
        self._step: tuple[tuple, RowMasks] | None = None  # (key, masks) of this step, until a commit

    # ---- committed state ---------------------------------------------------
    def commit(self, token: int) -> None:
        """Advances the state by one committed token; raises GrammarViolation if forbidden."""
        if not self.matcher.accept_token(int(token)):
            raise GrammarViolation(f"token {token} is not allowed by the constraint after "
                                   f"{self.num_committed} committed tokens")
        self.num_committed += 1
        self.last_token = int(token)
        self._step = None

    def fork(self) -> "GrammarState":
        """An independent copy of the committed state (n samples over one prefill)."""
        other = object.__new__(GrammarState)
        other.matcher = self.matcher.fork()
        other.vocab_size = self.vocab_size
        other.utf8_guard = self.utf8_guard
        other.encode = self.encode
        other._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        other.num_committed = self.num_committed
        other.last_token = self.last_token
        other._step = None
        return other

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    # ---- reads ------------------------------------------------------------------
    def mask_next(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [n, vocab] -> float32 copy with the LAST row masked (the sampled row)."""
        out = logits.float().clone()
        self.apply(out[-1:], self.step_masks())
        return out

    def mask_tree(self, rows: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """rows: [1 + num_nodes, vocab] verify logits (row 0 follows the committed output, row
        1 + i follows draft node i); tokens, parents: the draft tree's nodes (parents[i] in
        [-1, i)). Returns a float32 copy where each reachable row is masked with the state
        after its path. A node whose token the grammar forbids can never be accepted (its
        token is masked in its parent's row); its subtree's rows are left as they are."""
        out = rows.float().clone()
        self.apply(out, self.step_masks(tokens, parents))
        return out

    def mask_row(self, row: torch.Tensor, tokens: list[int], parents: list[int], r: int) -> None:
        """row: [1, vocab] float32 logits of verify row `r` of the draft tree (tokens, parents),
        masked in place as `mask_tree` masks that row (the step's masks, cached)."""
        masks = self.step_masks(tokens, parents)
        if r not in masks.masked:
            return
        xgr.apply_token_bitmask_inplace(row, masks.bitmask[r:r + 1])
        if self.utf8_guard is not None:
            self.utf8_guard.mask_(row[0], masks.prev_tokens[r])

    def apply(self, rows: torch.Tensor, masks: RowMasks) -> None:
        """rows: [len(masks.bitmask), vocab] float32 logits, masked in place."""
        if not masks.masked:
            return
        # A restricted row is already -inf wherever its mask is 0 (its ids are the mask's set bits).
        indices = [row for row in masks.masked if row not in masks.restricted]
        if indices:
            xgr.apply_token_bitmask_inplace(rows, masks.bitmask, indices=indices)
        if self.utf8_guard is not None:
            for row in masks.masked:
                self.utf8_guard.mask_(rows[row], masks.prev_tokens[row])

    def step_masks(self, tokens=(), parents=()) -> RowMasks:
        """The masks of this step's rows: row 0 after the committed output, row 1 + i after
        draft node i (tokens, parents: the draft tree; none for a plain row). Computed by a
        depth-first walk that accepts each node's token and rolls back after its subtree, so
        the committed state is left as it was; cached until the next commit."""
        tokens, parents = [int(t) for t in tokens], [int(p) for p in parents]
        key = (self.num_committed, tuple(tokens), tuple(parents))
        if self._step is not None and self._step[0] == key:
            return self._step[1]
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # by row: 0 = root
        for i, parent in enumerate(parents):
            children[parent + 1].append(i + 1)
        bitmask = xgr.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)  # [1 + n, words]
        masked: list[int] = []
        stack: list[tuple[int, int]] = [(0, 0)]  # (row, next child index): depth-first walk
        self._fill(bitmask, 0, masked)
        depth = 0
        while stack:
            row, k = stack[-1]
            if k == len(children[row]):
                stack.pop()
                if stack:  # leave `row`: back to its parent's state
                    self.matcher.rollback(1)
                    depth -= 1
                continue
            stack[-1] = (row, k + 1)
            child = children[row][k]
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(tokens[child - 1])):
                continue  # forbidden: never accepted, subtree unreachable
            depth += 1
            self._fill(bitmask, child, masked)
            stack.append((child, 0))
        assert depth == 0
        prev = (self.last_token, *tokens)
        masks = RowMasks(bitmask, tuple(sorted(masked)), prev)
        self._step = (key, masks)
        return masks

    def reachable(self, tokens: list[int], parents: list[int]) -> list[int]:
        """The draft nodes (ascending) whose whole path from the committed output the grammar
        accepts; every other node can never be accepted. The state is left as it was."""
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # by row: 0 = root
        for i, parent in enumerate(parents):
            children[int(parent) + 1].append(i + 1)
        kept: list[int] = []
        stack: list[tuple[int, int]] = [(0, 0)]  # (row, next child index): depth-first walk
        while stack:
            row, k = stack[-1]
            if k == len(children[row]):
                stack.pop()
                if stack:
                    self.matcher.rollback(1)
                continue
            stack[-1] = (row, k + 1)
            child = children[row][k]
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(tokens[child - 1])):
                continue
            kept.append(child - 1)
            stack.append((child, 0))
        return sorted(kept)

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next: the forced text as the model's tokenizer
        writes it, where the grammar accepts that tokenisation, else xgrammar's. The model may
        still split the text otherwise; verification then rejects the rest of the chain.

        Why not xgrammar's alone: it spells some characters with byte tokens (Gemma 3: `_` as
        <0x5F>) that the model never writes, so every forced `_` was rejected (the
        structured-outputs benchmark: 49% of forced drafts accepted, greedy)."""
        if limit <= 0 or self.matcher.is_terminated():
            return []
        if self.encode is not None:
            try:
                text = self.matcher.find_jump_forward_string()
            except UnicodeDecodeError:  # the forced bytes end inside a character: xgrammar's tokens
                text = ""
            native = self.encode(text)[:limit] if text else []
            if native and self._accepts(native):
                return native
        return self.matcher.find_jump_forward_tokens()[:limit]

    def _accepts(self, tokens: list[int]) -> bool:
        """Whether the grammar accepts `tokens` after the committed output (state left as it was)."""
        accepted = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted == len(tokens)

    def _fill(self, bitmask: torch.Tensor, row: int, masked: list[int]) -> None:
        if not self.matcher.is_terminated():  # a terminated path (stop token) samples nothing
            self.matcher.fill_next_token_bitmask(bitmask, row)
            masked.append(row)
