"""The lean forwards' per-row ops between the matmuls for bf16 activations (cpu_rowops.cpp):
Gemma 3's and the Llama family's, one implementation each, the norm's rounding a parameter.

`weight_after` picks the family's RMSNorm: False (Gemma 3) multiplies by the float32 weight
(1 + weight) before the one rounding to bf16; True (Llama, Qwen2/3, Mistral) rounds the normed
row first and multiplies by the bf16 weight (passed as float32) in a second rounding, as
LlamaRMSNorm does.

Part of specmesh's CPU kernel module (cpu_kernels.py builds it); available where it is.
Each returns what the lean forward's torch ops return, except that a norm's sum of squares is
added in another order (one bf16 rounding step at most; tests/target/test_cpu_rowops.py).
"""

from __future__ import annotations

import torch

from services.target.kernels import cpu_linear
from services.target.kernels.cpu_kernels import module

_NO_MASK = torch.empty(0, dtype=torch.bool)  # "no mask" to the C++ side (once, not per call and layer)


_NO_WEIGHT = torch.empty(0)  # "no norm" to the C++ side


def rms_norm(x: torch.Tensor, w1: torch.Tensor, eps: float, weight_after: bool = False) -> torch.Tensor:
    """x [R, D] bf16, w1 [D] or [W, D] f32 (1 + weight, or the bf16 weight with weight_after; row r
    uses w1[r % W]) -> [R, D] bf16."""
    return module().rms_norm_bf16(x, w1, eps, weight_after)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, w_a: torch.Tensor | None, w_next: torch.Tensor,
                 eps: float, weight_after: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h + rms_norm(a, w_a) (h + a where w_a is None), and rms_norm of that with w_next:
    ([R, D], [R, D]) bf16."""
    return module().add_rms_norm_bf16(h, a, _NO_WEIGHT if w_a is None else w_a, w_next, eps, weight_after)


def qk_norm_rope(qkv: torch.Tensor, w1: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int, eps: float, weight_after: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KV) * D] bf16, w1 [H + KV, D] f32 (None: no q/k norm), cos/sin [T, D] bf16 ->
    q [T, H, D], k [T, KV, D] (normed, rotated), v [T, KV, D]: contiguous bf16."""
    return module().qk_norm_rope_bf16(qkv, _NO_WEIGHT if w1 is None else w1, cos, sin, heads, kv_heads, eps,
                                      weight_after)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     tables: torch.Tensor, offsets: torch.Tensor, lens: torch.Tensor, masks: torch.Tensor | None,
                     scale: float, out: torch.Tensor) -> None:
    """Single query rows' attention over the paged bf16 pool, read in place (cpu_decode_attention.cpp).

    query/out [T, H, D] bf16; caches [num_blocks, block_size, KV, D] bf16; per row i: rows[i]
    its query row, tables[i] its block ids, entries offsets[i] .. offsets[i] + lens[i] - 1 of
    those blocks laid end to end (int64), of which it sees those masks[i] allows ([n, width]
    bool; None: all). Writes out[rows]; a row that sees nothing gets zeros."""
    module().decode_attention_bf16(query, k_cache, v_cache, rows, tables, offsets, lens,
                                               _NO_MASK if masks is None else masks, scale, out)


def store_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor,
                           offsets: torch.Tensor, lens: torch.Tensor, masks: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """A layer's new keys and values (key/value [T, KV, D] bf16) into their slots ([T] int64, < 0:
    not stored), then `decode_attention` over the pool, in one call -> [T, H, D] bf16 (zeros where
    no row writes)."""
    return module().store_decode_attention_bf16(query, key, value, k_cache, v_cache, slots, rows, tables, offsets,
                                                lens, _NO_MASK if masks is None else masks, scale)


def chunk_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pieces: torch.Tensor,
                    tables: torch.Tensor, bounds: torch.Tensor, scale: float, out: torch.Tensor,
                    amx: bool | None = None) -> None:
    """Prefill chunks' attention over the paged bf16 pool with VDPBF16PS, or AMX tiles where
    cpu_linear.amx() (cpu_chunk_attention.cpp; amx=False keeps VDPBF16PS); AVX512-BF16 CPUs only
    (cpu_linear.bf16_dot_instruction).

    query/out [T, H, D] bf16; caches [num_blocks, block_size, KV, D] bf16; pieces [P, 4] int64
    (q_start, q_len, kv_offset, kv_len): rows q_start .. q_start + q_len - 1 over entries
    kv_offset .. kv_offset + kv_len - 1 of the blocks tables[P, max_blocks] laid end to end;
    bounds [rows, 2] int64, row by row of the pieces: the run [lo, hi) of that range the row sees.
    Writes the pieces' rows of out; a row that sees nothing gets zeros."""
    module().chunk_attention_bf16(query, k_cache, v_cache, pieces, tables, bounds, scale, out,
                                  cpu_linear.amx() if amx is None else amx)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bf16 (gate | up) -> gelu(gate, approximate="tanh") * up [T, I] bf16."""
    return module().gelu_tanh_mul_bf16(gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bf16 (gate | up) -> silu(gate) * up [T, I] bf16."""
    return module().silu_mul_bf16(gate_up)


def masked_softmax_(scores: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """scores [B, R, N] bf16 (contiguous), hidden [R, N] bool or None -> the same tensor holding
    softmax(scores.masked_fill(hidden, -inf), -1) in bf16 (float32 inside); rows that see nothing: 0."""
    module().masked_softmax_bf16_(scores, _NO_MASK if hidden is None else hidden.contiguous())
    return scores


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, N] float32, contiguous, on the CPU -> (index [M] int64, ok [M] bool): each row's
    first index of its largest value (torch.argmax's answer) where ok, i.e. where the row has no NaN
    and that value is finite (cpu_argmax_rows.cpp: one vectorized pass, ~10x torch's at 18 rows)."""
    return module().argmax_rows_f32(logits)
