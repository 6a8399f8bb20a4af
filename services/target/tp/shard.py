"""Cuts a loaded model down to one rank's shard of a tensor-parallel target, at load time, so that
the lean forwards (gemma3_forward.py, llama_forward.py) run unchanged on every rank:

  * column-parallel: each layer's fused q/k/v keeps this rank's query heads and KV heads (the KV
    pool then holds only those heads: `ModelSpec.num_kv_heads`), fused gate/up its slice of the
    intermediate columns. Attention is per head, so a rank's heads need nothing from the others.
  * row-parallel: o_proj and down_proj keep the matching input columns and sum their partial
    outputs over the ranks (`RowParallelLinear`: one all-reduce each, two per layer).
  * vocabulary-parallel: the lm_head keeps its slice of the vocabulary and the ranks' logits are
    gathered side by side (`VocabParallelLinear`), so sampling on rank 0 sees every logit.
  * replicated: the embedding (a lookup, no compute to share; a tied lm_head is copied before it is
    cut), the norms and RoPE.

The model's config then describes the shard (heads, KV heads and intermediate size per rank),
which is what the lean forwards read. Only models a lean forward runs qualify: transformers'
modules (the generic path) are refused with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from services.target.model import lean_forward
from services.target.model.gemma3_forward import FUSED


def shard_model(model: nn.Module, tp) -> None:
    """Replaces the fused projections, o_proj, down_proj and lm_head of `model` by rank `tp.rank`'s
    shards (in place; before packing). ValueError where the model cannot be split `tp.world` ways."""
    config = model.config
    check_shardable(model, tp.world)
    rank, world = tp.rank, tp.world
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = config.intermediate_size
    fused = getattr(model, FUSED)
    q_rows = _slice(rank, world, heads * head_dim)  # [heads / world * head_dim] rows of q in qkv
    kv_rows = _slice(rank, world, kv_heads * head_dim)
    qkv_rows = torch.cat([q_rows, heads * head_dim + kv_rows, (heads + kv_heads) * head_dim + kv_rows])
    inter_rows = _slice(rank, world, inter)
    for i, layer in enumerate(model.model.layers[:config.num_hidden_layers]):
        setattr(fused, f"qkv_{i}", _rows(getattr(fused, f"qkv_{i}"), qkv_rows))
        gate_up_rows = torch.cat([inter_rows, inter + inter_rows])  # this rank's gate columns, then its up columns
        setattr(fused, f"gate_up_{i}", _rows(getattr(fused, f"gate_up_{i}"), gate_up_rows))
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, q_rows, tp)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, inter_rows, tp)
    vocab_rows = _slice(rank, world, model.lm_head.out_features)
    model.lm_head = VocabParallelLinear(_rows(model.lm_head, vocab_rows), tp)
    config.head_dim = head_dim
    config.num_attention_heads, config.num_key_value_heads = heads // world, kv_heads // world
    config.intermediate_size = inter // world


def check_shardable(model: nn.Module, world: int) -> None:
    """ValueError saying why `model` cannot run as `world` tensor-parallel ranks, if it cannot."""
    config = model.config
    if not (lean_forward.supports(model) and hasattr(model, FUSED)):
        raise ValueError(f"tensor parallelism runs the lean forwards only (Gemma 3 text, the Llama family); "
                         f"{type(model).__name__} would run transformers' modules, which are not sharded: "
                         "serve it with tensor_parallel 1")
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": model.lm_head.out_features}
    uneven = [f"{name} {value}" for name, value in sizes.items() if value % world]
    if uneven:
        raise ValueError(f"tensor_parallel {world} must divide {', '.join(uneven)} "
                         f"({type(model).__name__}); choose a divisor")


class RowParallelLinear(nn.Module):
    """This rank's input columns of a linear layer; the ranks' partial outputs summed (all-reduce),
    then the bias once. x: [T, in / world] -> [T, out]."""

    def __init__(self, linear: nn.Linear, columns: torch.Tensor, tp) -> None:
        super().__init__()
        self.tp = tp
        self.shard = _new_linear(linear.weight.detach()[:, columns], None)  # [out, in / world]; packed later
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)  # [out] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.shard(x).contiguous())  # [T, out]
        return y if self.bias is None else y + self.bias


class VocabParallelLinear(nn.Module):
    """This rank's rows of the vocabulary; the ranks' logits gathered side by side.
    h: [R, hidden] -> [R, vocab]."""

    def __init__(self, shard: nn.Linear, tp) -> None:
        super().__init__()
        self.tp = tp
        self.shard = shard  # [vocab / world, hidden]; packed later (float32 outputs, as the lm_head's)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = self.shard(h)  # [R, vocab / world]
        if local.shape[0] == 0:  # no logits this step: every rank skips the gather alike
            return local.new_empty(0, local.shape[1] * self.tp.world)
        return self.tp.all_gather(local)


def _slice(rank: int, world: int, n: int) -> torch.Tensor:  # [n / world] indices of rank's contiguous part
    part = n // world
    return torch.arange(rank * part, (rank + 1) * part)


def _rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A new nn.Linear of `linear`'s output rows (copied: a tied weight stays whole for its other user)."""
    bias = linear.bias.detach()[rows] if linear.bias is not None else None
    return _new_linear(linear.weight.detach()[rows], bias)


def _new_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:  # weight: [out, in]
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out
