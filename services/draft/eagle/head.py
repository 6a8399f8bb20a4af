"""The feature head (EAGLE-style draft): one decoder layer that predicts the target's next
last-layer feature from its current one and the next token.

Words (docs/DESIGN.md section 5 for draft / accepted / bonus): a *feature* f_j is the target's
last-layer hidden state at position j after its final norm (what its LM head reads, so
`lm_head(f_j)` are the target's logits for token j + 1). The head's input at *head position* j
is [embed(t_{j+1}); f_j]; its output, put through the target's final norm, is the *predicted
feature* f̂_{j+1}, and `lm_head(f̂_{j+1})` is the draft distribution of token j + 2. Drafting
feeds predicted features back in: [embed(d_1); f̂_{j+1}] -> f̂_{j+2}, ...

Shape of the head (EAGLE, arXiv 2401.15077; EAGLE-3, arXiv 2503.01840; SafeAILab/EAGLE's
`cnets.py` and vLLM's `llama_eagle.py` follow the same outline): RMSNorm each half of the input,
`fc` [2 * hidden -> hidden], then one pre-norm decoder layer (RoPE self-attention over the
sequence's earlier head positions, SwiGLU MLP). The target's embedding, final norm and LM head
are frozen and reused (`TargetParts`, loaded from the target's directory); only this module's
weights are saved with the head.

Attention comes in two forms: `forward` (a causal prefix of cached keys plus new rows under an
explicit mask: serving, chains and trees) and `forward_ttt` (training on the head's own
recursive predictions, EAGLE-3's training-time test: the step-s query of a chain sees the
step-1 keys of the true-feature context and the diagonal keys of its own earlier steps).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    draft_vocab_size: int = 0  # tokens the head scores (services/draft/eagle/draft_vocab.py); 0 = all

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE), got {self.head_dim}")

    @classmethod
    def for_target(cls, config, draft_vocab_size: int = 0) -> HeadConfig:
        """The head of a target with this (text) config: its hidden size, heads and MLP width."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.hidden_size, heads, head_dim, config.intermediate_size,
                   float(getattr(config, "rms_norm_eps", 1e-6)), draft_vocab_size=draft_vocab_size)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        xf = x.float()
        return (torch.rms_norm(xf, (xf.shape[-1],), None, self.eps) * self.weight.float()).type_as(x)


class FeatureHead(nn.Module):
    """fc over [norm(embedding); norm(feature)], then one decoder layer (pre-norm output: the
    caller applies the target's final norm to get the predicted feature)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.feature_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv = nn.Linear(c.hidden_size, 3 * c.num_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        # the token ids the head scores, ascending (saved with the head; None: the whole vocabulary)
        self.register_buffer("draft_vocab", torch.zeros(c.draft_vocab_size, dtype=torch.long)
                             if c.draft_vocab_size else None)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, features: [n, hidden] (one sequence; or [b, n, hidden] for a batch, every
        shape below then with a leading b); positions: [n] head positions; past_k / past_v:
        [heads, s, head_dim] cached keys and values (RoPE'd) or None; mask: [n, s + n] bool
        (True = may attend; [b, 1, n, s + n] for a batch) or None for causal over the new rows
        with every past key visible. Returns (output [n, hidden] pre-norm, k [heads, n, head_dim],
        v [heads, n, head_dim]) of the new rows."""
        x = self._input(embeds, features)  # [n, hidden]
        q, k, v = self._qkv(self.attn_norm(x), positions)  # [heads, n, head_dim] each
        keys = k if past_k is None else torch.cat([past_k, k], dim=-2)  # [heads, s + n, head_dim]
        values = v if past_v is None else torch.cat([past_v, v], dim=-2)
        one_row = mask is None and q.shape[-2] == 1  # a lone new row sees every key: nothing to mask
        if mask is None and not one_row:
            n, s = q.shape[1], keys.shape[1] - q.shape[1]
            mask = torch.ones(n, s + n, dtype=torch.bool, device=q.device)
            mask[:, s:] = torch.tril(mask[:, s:])
        if q.shape[-2] <= _SMALL_QUERIES:  # drafting: a few rows, where SDPA's CPU kernel costs ~0.3 ms a call
            scores = (q.float() @ keys.float().transpose(-1, -2)) / math.sqrt(self.config.head_dim)  # [.., n, s + n]
            probs = torch.softmax(scores if one_row else scores.masked_fill(~mask, float("-inf")), dim=-1)
            a = (probs @ values.float()).to(q.dtype)  # [heads, n, head_dim]
        else:
            a = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [heads, n, head_dim]
        return self._rest(x, a), k, v

    def forward_ttt(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                    context: tuple[torch.Tensor, torch.Tensor] | None,
                    diagonal: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training, one recursion step over a batch: embeds, features [b, t, hidden]; positions
        [b, t]; `context`: step 1's (k, v) [b, heads, t, head_dim] (None on step 1: the step's
        own keys are the context); `diagonal`: (k, v) of steps 2..s-1. Row j of step s attends
        context keys 0..j (causal) and row j of every diagonal step and of itself.
        Returns (output [b, t, hidden], k, v [b, heads, t, head_dim])."""
        x = self._input(embeds, features)  # [b, t, hidden]
        q, k, v = self._qkv(self.attn_norm(x), positions)  # [b, heads, t, head_dim]
        ctx_k, ctx_v = (k, v) if context is None else context
        scale = 1.0 / math.sqrt(self.config.head_dim)
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = (q @ ctx_k.transpose(-1, -2)) * scale  # [b, heads, t, t]
        scores = scores.masked_fill(~causal, float("-inf"))
        own = [] if context is None else [*diagonal, (k, v)]
        diag = [((q * dk).sum(-1) * scale)[..., None] for dk, _ in own]  # each [b, heads, t, 1]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)  # [b, heads, t, t + len(own)]
        a = probs[..., :t] @ ctx_v  # [b, heads, t, head_dim]
        for i, (_, dv) in enumerate(own):
            a = a + probs[..., t + i, None] * dv
        return self._rest(x, a), k, v

    def use_fast_linears(self) -> None:
        """Serving in bf16 on a CPU: the decoder layer's linears through specmesh's bf16 kernel
        (packed copies of the weights; torch's bf16 linear at one row took ~45% of a draft
        token). Within one bf16 rounding of torch's; training keeps nn.Linear."""
        for name in ("fc", "qkv", "o_proj", "gate_up", "down"):
            setattr(self, name, fast_bf16_linear(getattr(self, name)))

    # ---- helpers ------------------------------------------------------------------------

    def _input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embed_norm(embeds), self.feature_norm(features)], dim=-1))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., n, hidden] -> q, k, v [..., heads, n, head_dim], q and k rotated."""
        c = self.config
        qkv = self.qkv(x).unflatten(-1, (3, c.num_heads, c.head_dim))  # [..., n, 3, heads, head_dim]
        q, k, v = (qkv.select(-3, i).transpose(-2, -3) for i in range(3))  # [..., heads, n, head_dim]
        cos, sin = _rope(positions, c.head_dim, c.rope_theta, x.dtype)  # [..., 1, n, head_dim]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _rest(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Attention output a [..., heads, n, head_dim] -> the layer's output [..., n, hidden]."""
        h = x + self.o_proj(a.transpose(-2, -3).flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(nn.functional.silu(gate) * up)


_SMALL_QUERIES = 64  # query rows up to which attention is plain matmuls and softmax in float32


@functools.lru_cache(maxsize=8)
def _inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's [head_dim / 2] inverse frequencies (computed once per shape, not per head call)."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


_ROPE_TABLE_MIN = 4096  # positions a table holds at first; doubled past it


@functools.lru_cache(maxsize=16)
def _rope_table(head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
                size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [size, head_dim] of positions 0 .. size - 1: each angle the same float32 product
    (position x inverse frequency) a per-call computation makes, so the same values."""
    angles = torch.arange(size, device=device, dtype=torch.float32)[:, None] * _inverse_frequencies(head_dim, theta, device)
    emb = torch.cat([angles, angles], dim=-1)  # [size, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope(positions: torch.Tensor, head_dim: int, theta: float,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., n] -> cos, sin [..., 1, n, head_dim], looked up in a table (a draft step
    rotates one or a few rows: the table saves the half-dozen small ops a step would run)."""
    size = _ROPE_TABLE_MIN
    if positions.numel():
        smallest, largest = (int(x) for x in torch.aminmax(positions))
        if smallest < 0:
            raise ValueError(f"RoPE positions must be >= 0, got {smallest}")
        while size <= largest:
            size *= 2
    cos, sin = _rope_table(head_dim, theta, positions.device, dtype, size)
    return cos[positions][..., None, :, :], sin[positions][..., None, :, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fast_bf16_linear(linear: nn.Linear) -> nn.Module:
    """`linear` (bf16) through specmesh's bf16 CPU kernel where it builds, else itself."""
    from services.target.kernels import cpu_linear
    if not cpu_linear.available():
        return linear
    from services.target.model.linear import AVX512LinearBF16
    return AVX512LinearBF16(linear)
