"""Gemma 3's text forward over the paged KV pool, op for op as transformers computes it.

transformers' own forward (which the engine runs for every other model) spends a third of a
single-stream decode step outside the matmuls: module hooks, output capturing, mask builders,
kwargs plumbing, and per call the `1 + weight` of every RMSNorm and RoPE's cos/sin per layer
(docs/kernels.md). This forward reads the same modules' weights and
runs the same tensor operations in the same order, so its logits equal transformers' bit for
bit (tests/target/test_gemma3_forward.py, float32 and bf16), minus that machinery:

  * each RMSNorm's `1 + weight` in float32 is computed once, at load (the same values);
  * cos/sin are computed once per step for each RoPE kind (sliding / full), not per layer, and
    q and k are normed and rotated side by side in one pass (the same per-row operations);
  * activations stay [num_tokens, ...] without the batch dimension and its transposes;
  * q/k/v and gate/up are one matmul each (`fuse_projections`, at load): each output column is
    the same dot product, bit for bit (checked at M = 1, 11 and 512 on the default model's shapes
    for bf16 oneDNN and float32 MKL), and a decode step reads the weights in 36 calls instead of
    90, which is faster.

Only Gemma 3 text models with default or linear RoPE, no attention soft-capping and causal
attention qualify (`supports`); anything else keeps transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.target.model.attention import AttentionMetadata, paged_attention
from services.target.kernels import cpu_linear, cpu_rowops
from services.target.model import decode_layer
from services.target.model.gguf_weights import GGUFLinear, tied_embedding_rows
from services.target.model.linear import AVX512LinearBF16, direct_rows
from services.target.model.output_layer import OutputLayer
from services.target.model.output_rows import OutputRows, attend_rows

_STATIC_ROPE = ("default", "linear")  # inv_freq fixed at load; dynamic kinds rescale per call


def supports(model: nn.Module) -> bool:
    """Whether `model` is a Gemma 3 text model this forward computes exactly."""
    if type(model).__name__ != "Gemma3ForCausalLM":
        return False
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    return (not getattr(config, "attn_logit_softcapping", None)
            and not getattr(config, "use_bidirectional_attention", False)
            and all(rope.get(t, {}).get("rope_type", "default") in _STATIC_ROPE for t in set(config.layer_types)))


from services.target.model.fused_name import FUSED  # noqa: E402  the model's submodule holding the fused projections


class _Columns(nn.Module):
    """Columns [start, end) of a fused projection's output, standing in for q_proj, k_proj, ...
    so transformers' own forward (tests, A/B) still runs; it computes the fused product per call."""

    def __init__(self, fused: nn.Module, name: str, start: int, end: int) -> None:
        super().__init__()
        self._fused = [fused]  # a list: not a submodule, so packing sees each fused layer once
        self.name, self.start, self.end = name, start, end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self._fused[0], self.name)(x)[..., self.start:self.end]


def _concat(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the outputs of `linears`, side by side."""
    first = linears[0]
    out = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                    dtype=first.weight.dtype, device=first.weight.device)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in linears]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([m.bias for m in linears]))
    return out


def fuse_projections(model: nn.Module) -> None:
    """Replaces each layer's q/k/v and gate/up projections by one fused nn.Linear each (in
    `model.specmesh_fused`, packed later with the rest) and column views for transformers' forward."""
    fused = nn.Module()
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = {"qkv": (attn, ("q_proj", "k_proj", "v_proj")), "gate_up": (mlp, ("gate_proj", "up_proj"))}
        for kind, (owner, names) in parts.items():
            linears = [getattr(owner, n) for n in names]
            fused.add_module(f"{kind}_{i}", _concat(linears))
            start = 0
            for n, m in zip(names, linears):
                setattr(owner, n, _Columns(fused, f"{kind}_{i}", start, start + m.out_features))
                start += m.out_features
    model.add_module(FUSED, fused)


def _rms_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm: normalised in float32, times (1 + weight) in float32, back to x's dtype.

    torch.rms_norm computes xf * rsqrt(mean(xf^2) + eps) * w1 as transformers does, bit for bit
    (0 of 19.9M bf16 outputs differed on random rows of the model's shapes), in 2 ops instead of 7
    (at one decode row each op costs its dispatch time).
    A per-head weight [heads, head_dim] (q/k norm) multiplies after, as transformers' does."""
    xf = x.float()
    if w1.dim() == 1:
        return torch.rms_norm(xf, (xf.shape[-1],), w1, eps).type_as(x)
    return (torch.rms_norm(xf, (xf.shape[-1],), None, eps) * w1).type_as(x)


def choose_row_ops(row_ops: bool | None, lm_head: nn.Module, embed: nn.Module) -> bool:
    """Whether a lean forward runs the C++ row ops: as asked, or (None) where the linear layers
    are specmesh's kernel (which already gave up bit-exactness) and the model is bf16."""
    if row_ops is None:
        lm_head = getattr(lm_head, "shard", lm_head)  # a tensor-parallel rank's (tp/shard.py)
        row_ops = isinstance(lm_head, (AVX512LinearBF16, GGUFLinear)) and embed.weight.dtype == torch.bfloat16
    if row_ops and not cpu_linear.available():
        raise ValueError(f"row_ops cannot run here: {cpu_linear.unavailable_reason()}")
    return row_ops


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class _Layer:
    index: int
    sliding_window: int | None
    rope: str  # layer type: which cos/sin it uses
    input_norm: torch.Tensor  # [hidden] f32, 1 + weight
    # The projections as `linear.direct_rows` gives them: [T, in] -> [T, out]
    qkv_proj: nn.Module  # fused: [T, hidden] -> [T, (heads + 2 kv heads) * head_dim]
    qk_norm: torch.Tensor  # [num_heads + num_kv_heads, head_dim] f32: q_norm's per query head, then k_norm's
    o_proj: nn.Module
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate_up_proj: nn.Module  # fused: [T, hidden] -> [T, 2 * intermediate]
    down_proj: nn.Module
    post_feedforward_norm: torch.Tensor


def _one_plus(norm: nn.Module) -> torch.Tensor:
    return 1.0 + norm.weight.detach().float()


class Gemma3PagedForward:
    """Callable: (input_ids [T], position_ids [T], logit_rows [R], meta) -> logits [R, vocab].

    row_ops: the norms, residual adds, q/k norm + RoPE and GELU * up through specmesh's C++ row
    ops (kernels/cpu_rowops.cpp) instead of ~20 torch ops a layer; attention in C++ too
    (the model runner then picks the cpu kernels with cpp_attention). They round as torch does but add a
    norm's squares in another order, so the logits are no longer transformers' bit for bit. None
    (default): where the linear layers are already specmesh's kernel (`--weights bf16-avx512`),
    which gave up that exactness; the `bf16` (oneDNN) and float32 paths stay exact.
    """

    def __init__(self, model: nn.Module, row_ops: bool | None = None) -> None:
        if not supports(model) or not hasattr(model, FUSED):
            raise ValueError(f"{type(model).__name__} is not a Gemma 3 text model with fused projections "
                             "(services.target.model.gemma3_forward.fuse_projections)")
        text, config = model.model, model.config
        self.config = config
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.embed = text.embed_tokens
        self.embed_rows = tied_embedding_rows(model)  # the lookup in the lm_head's GGUF blocks, or None
        self.final_norm = _one_plus(text.norm)
        self.lm_head = model.lm_head
        self.softcap = config.final_logit_softcapping
        self.output = OutputLayer(model, self.embed, self.embed_rows, self.softcap)  # full or subset rows
        rotary = text.rotary_emb
        self.rope = {t: (getattr(rotary, f"{t}_inv_freq"), getattr(rotary, f"{t}_attention_scaling"))
                     for t in set(config.layer_types)}
        fused = getattr(model, FUSED)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = config.intermediate_size
        self.scaling = text.layers[0].self_attn.scaling  # every layer's: query_pre_attn_scalar ** -0.5
        self.act = text.layers[0].mlp.act_fn  # config.hidden_activation, the same in every layer
        self.row_ops = row_ops = choose_row_ops(row_ops, self.lm_head, self.embed)
        self.gelu_tanh = row_ops and getattr(config, "hidden_activation", None) == "gelu_pytorch_tanh"
        self.layers = []
        for i, layer in enumerate(text.layers[:config.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                i, attn.sliding_window, config.layer_types[i], _one_plus(layer.input_layernorm),
                direct_rows(getattr(fused, f"qkv_{i}")),
                torch.cat([_one_plus(attn.q_norm).expand(self.num_heads, -1),
                           _one_plus(attn.k_norm).expand(self.num_kv_heads, -1)]),
                direct_rows(attn.o_proj), _one_plus(layer.post_attention_layernorm),
                _one_plus(layer.pre_feedforward_layernorm), direct_rows(getattr(fused, f"gate_up_{i}")),
                direct_rows(mlp.down_proj), _one_plus(layer.post_feedforward_layernorm)))
        # A decode step's layer in one C++ call (decode_layer.py) where its linears allow
        self.fused_parts = decode_layer.LayerParts([(layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
                                                    for layer in self.layers]) if self.gelu_tanh else None

    @property
    def takes_output_rows(self) -> bool:
        """Whether a step's last layer may compute only its read rows (output_rows.py): on the
        row-ops path, whose kernels compute each row alone."""
        return self.row_ops

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """Per RoPE kind: (cos, sin) [T, 1, head_dim] in the activations' dtype (Gemma3RotaryEmbedding)."""
        out = {}
        for kind, (inv_freq, scaling) in self.rope.items():
            freqs = positions[:, None].float() * inv_freq.float()  # [T, head_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
            out[kind] = ((emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None])
        return out

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logit_rows: torch.Tensor,
                 meta: AttentionMetadata, feature_rows: torch.Tensor | None = None,
                 vocab_subsets: dict[int, torch.Tensor] | None = None, read: OutputRows | None = None):
        """-> logits [R, vocab]; with `feature_rows` [F] also the features of those rows (the last
        layer's output after the final norm, [F, hidden]): (logits, features). `vocab_subsets`
        {logit row: allowed ids}: those rows' logits only over those ids, -inf elsewhere
        (services/target/model/output_layer.py). `read`: the rows whose last-layer output is read
        (output_rows.py), taken by the row-ops path (`takes_output_rows`) where no features are asked
        for; the exact torch path computes every row."""
        embed = self.embed
        if self.embed_rows is not None:  # the same bf16 values, read from the tied GGUF blocks
            h = self.embed_rows(input_ids)
        else:
            h = nn.functional.embedding(input_ids, embed.weight, embed.padding_idx)
        h = h * embed.embed_scale.to(embed.weight.dtype)  # [T, hidden]
        rope = self._cos_sin(position_ids, h.dtype)
        if self.row_ops:
            return self._call_row_ops(h, rope, logit_rows, meta, feature_rows, vocab_subsets,
                                      read if feature_rows is None else None)
        num_tokens, eps = h.shape[0], self.eps
        for layer in self.layers:
            cos, sin = rope[layer.rope]
            x = _rms_norm(h, layer.input_norm, eps)
            qkv = layer.qkv_proj(x)  # [T, q_size + 2 * kv_size]
            # q and k side by side: one norm (per head row, each with its own weight) and one RoPE
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)  # [T, H + KV, D]
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            qk = _rms_norm(qk, layer.qk_norm, eps)
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :self.num_heads].contiguous()  # [T, H, D]
            k = qk[:, self.num_heads:].contiguous()  # [T, KV, D]
            a = paged_attention(meta, layer.index, q, k, v.contiguous(), self.scaling, layer.sliding_window)
            a = layer.o_proj(a.reshape(num_tokens, -1))
            h = h + _rms_norm(a, layer.post_attention_norm, eps)
            x = _rms_norm(h, layer.pre_feedforward_norm, eps)
            gate_up = layer.gate_up_proj(x)  # [T, 2 * intermediate]
            x = layer.down_proj(self.act(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:])
            h = h + _rms_norm(x, layer.post_feedforward_norm, eps)
        logits = self.output(_rms_norm(h.index_select(0, logit_rows), self.final_norm, eps), vocab_subsets)  # norm is per row
        if feature_rows is None:
            return logits
        return logits, _rms_norm(h.index_select(0, feature_rows), self.final_norm, eps)

    def _call_row_ops(self, h: torch.Tensor, rope: dict, logit_rows: torch.Tensor,
                      meta: AttentionMetadata, feature_rows: torch.Tensor | None = None,
                      vocab_subsets: dict[int, torch.Tensor] | None = None, read: OutputRows | None = None):
        """The loop of __call__ with each layer's norms, residual adds and q/k norm + RoPE fused
        into three C++ row ops: each residual add runs with the norm after it (the next layer's
        input norm, or the final norm, which is per row, so computing it on every row and
        selecting the logit rows after gives the same rows)."""
        eps = self.eps
        x = cpu_rowops.rms_norm(h, self.layers[0].input_norm, eps)
        fused = self.fused_parts(x.shape[0]) if self.fused_parts is not None else None  # per layer, or None: nine calls
        for i, layer in enumerate(self.layers):
            cos, sin = rope[layer.rope]  # [T, 1, D]
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            attention = decode_layer.LayerParts.attention(fused, read, i, meta, layer.index, self.head_dim,
                                                          layer.sliding_window)
            if attention is not None:  # every row a decode row: the layer in one C++ call
                h, x = decode_layer.decode_layer(x, h, fused[i], layer.qk_norm, cos, sin, self.num_heads,
                                                 self.num_kv_heads, attention, self.scaling,
                                                 layer.post_attention_norm, layer.pre_feedforward_norm,
                                                 layer.post_feedforward_norm, next_norm, eps)
                continue
            qkv = layer.qkv_proj(x)  # [T, q_size + 2 * kv_size]
            q, k, v = cpu_rowops.qk_norm_rope(qkv, layer.qk_norm, cos, sin, self.num_heads, self.num_kv_heads, eps)
            last = read if i == len(self.layers) - 1 else None  # past its keys and values, only the rows read
            a, h, logit_rows = attend_rows(meta, last, layer.index, q, k, v, self.scaling, layer.sliding_window,
                                           h, logit_rows)
            a = layer.o_proj(a.flatten(1))  # [rows, H * D]
            h, x = cpu_rowops.add_rms_norm(h, a, layer.post_attention_norm, layer.pre_feedforward_norm, eps)
            gate_up = layer.gate_up_proj(x)  # [T, 2 * intermediate]
            if self.gelu_tanh:
                d = layer.down_proj(cpu_rowops.gelu_tanh_mul(gate_up))
            else:
                d = layer.down_proj(self.act(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:])
            h, x = cpu_rowops.add_rms_norm(h, d, layer.post_feedforward_norm, next_norm, eps)
        logits = self.output(x.index_select(0, logit_rows), vocab_subsets)  # [R, vocab]
        return logits if feature_rows is None else (logits, x.index_select(0, feature_rows))
