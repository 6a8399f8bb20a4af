"""The Llama family's text forward over the paged KV pool, op for op as transformers computes it.

Llama 3.x, Qwen2/2.5 (q/k/v biases), Qwen3 (per-head q/k norms) and Mistral (a sliding window)
are one decoder: embed, then per layer `h + attn(norm(h))`, `h + mlp(norm(h))` with RoPE'd
causal attention and `act(gate) * up`, then the final norm and the LM head (tied or not). This
forward reads the modules' own weights and runs the same tensor operations as transformers'
modules in the same order, so its logits equal theirs bit for bit in float32 and in bf16
(tests/target/test_llama_forward.py), without transformers' per-call machinery (module hooks,
mask builders, kwargs plumbing, RoPE per layer, the batch dimension and its transposes). As for
Gemma 3 (gemma3_forward.py, whose fused projections this shares): q/k/v and gate/up are one
matmul each, cos/sin are computed once per step, and q and k are normed and rotated side by side.

Differences from Gemma 3 that the shared pieces needed to take as parameters, not copies:
  * RMSNorm rounds before the weight: `weight * bf16(x * rsqrt(mean(x^2) + eps))` (Gemma:
    `bf16(x * rsqrt(..) * (1 + weight))` in float32), with the weight in the model's dtype;
  * the q/k norm is optional (Qwen3 only), q/k/v may have biases (Qwen2), no embedding scale,
    no final soft-capping, and each layer's sliding window comes from its attention module.

With specmesh's linear kernel (`--weights bf16-avx512`, what `auto` picks for bf16 on AVX-512 and
AVX2 CPUs) the glue between the matmuls runs as Gemma 3's does, through the same C++ row ops
(kernels/cpu_rowops.cpp, `weight_after` for this family's norm rounding; SwiGLU's silu * up): one
residual add + next norm per sublayer, q/k (norm +) RoPE in one pass; and the model runner then
attends in C++ where the pool is bf16. Those round as torch does but add a norm's squares in
another order, so, as for Gemma 3, that path gives up bit-exactness with transformers.

Only static RoPE kinds qualify (inv_freq fixed at load: default, linear, llama3, yarn); the
dynamic ones rescale per call and keep transformers' forward (`supports`), as do MoE models
and every other architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.target.kernels import cpu_rowops
from services.target.model import decode_layer
from services.target.model.attention import AttentionMetadata, paged_attention
from services.target.model.gemma3_forward import FUSED, _rotate_half, choose_row_ops
from services.target.model.linear import direct_rows
from services.target.model.output_layer import OutputLayer
from services.target.model.output_rows import OutputRows, attend_rows

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load


def supports(model: nn.Module) -> bool:
    """Whether `model` is a Llama-family decoder this forward computes exactly."""
    if type(model).__name__ not in ARCHITECTURES:
        return False
    rope = getattr(model.config, "rope_parameters", None) or {}
    return rope.get("rope_type", "default") in _STATIC_ROPE


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm (Qwen2/3's and Mistral's are the same): normalised in float32, back to x's
    dtype, then times the weight in that dtype. torch.rms_norm without a weight computes
    xf * rsqrt(mean(xf^2) + eps) as transformers does, bit for bit (tests, float32 and bf16).
    weight: [D], or [heads, D] for q and k side by side."""
    xf = x.float()
    return weight * torch.rms_norm(xf, (xf.shape[-1],), None, eps).to(x.dtype)


@dataclass
class _Layer:
    index: int
    sliding_window: int | None
    input_norm: torch.Tensor  # [hidden], the model's dtype
    qkv_proj: nn.Module  # fused, as linear.direct_rows gives it: [T, hidden] -> [T, (heads + 2 kv heads) * head_dim] (+ bias: Qwen2)
    qk_norm: torch.Tensor | None  # [num_heads + num_kv_heads, head_dim]: q_norm's per query head, then k_norm's (Qwen3)
    o_proj: nn.Module
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: nn.Module  # fused: [T, hidden] -> [T, 2 * intermediate]
    down_proj: nn.Module


def _weight(norm: nn.Module) -> torch.Tensor:
    return norm.weight.detach()


def _sliding_window(config, attn: nn.Module) -> int | None:
    """The window the layer's attention passes to the attention function: Qwen2/3 set it per
    layer (layer_types), Mistral's every layer takes config.sliding_window, Llama has none."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(config, "sliding_window", None)


class LlamaPagedForward:
    """Callable: (input_ids [T], position_ids [T], logit_rows [R], meta) -> logits [R, vocab].

    row_ops: the norms, residual adds, q/k (norm +) RoPE and silu * up through specmesh's C++ row
    ops (as Gemma3PagedForward's; the model runner reads it for the C++ attention). None
    (default): where the linear layers are specmesh's kernel and the model is bf16.
    """

    def __init__(self, model: nn.Module, row_ops: bool | None = None) -> None:
        if not supports(model) or not hasattr(model, FUSED):
            raise ValueError(f"{type(model).__name__} is not a Llama-family model with fused projections "
                             "(services.target.model.gemma3_forward.fuse_projections)")
        text, config = model.model, model.config
        self.config = config
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        first = text.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling  # head_dim ** -0.5 in every layer
        self.act = text.layers[0].mlp.act_fn  # config.hidden_act, the same in every layer
        self.embed = text.embed_tokens
        self.final_norm = _weight(text.norm)
        self.lm_head = model.lm_head
        self.output = OutputLayer(model, self.embed)  # full or subset rows (output_layer.py)
        self.inv_freq = text.rotary_emb.inv_freq  # [head_dim / 2] f32
        self.rope_scaling = text.rotary_emb.attention_scaling
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = config.intermediate_size
        fused = getattr(model, FUSED)
        self.row_ops = row_ops = choose_row_ops(row_ops, self.lm_head, self.embed)
        self.silu = row_ops and getattr(config, "hidden_act", None) == "silu"
        self.layers = []
        for i, layer in enumerate(text.layers[:config.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            qk_norm = None
            if hasattr(attn, "q_norm"):
                qk_norm = torch.cat([_weight(attn.q_norm).expand(self.num_heads, -1),
                                     _weight(attn.k_norm).expand(self.num_kv_heads, -1)])
            self.layers.append(_Layer(
                i, _sliding_window(config, attn), _weight(layer.input_layernorm), direct_rows(getattr(fused, f"qkv_{i}")),
                qk_norm, direct_rows(attn.o_proj), _weight(layer.post_attention_layernorm),
                direct_rows(getattr(fused, f"gate_up_{i}")), direct_rows(mlp.down_proj)))
        # The C++ row ops take each norm's weight as float32 (the bf16 values, exactly).
        self.row_weights = [(layer.input_norm.float(), None if layer.qk_norm is None else layer.qk_norm.float(),
                             layer.post_attention_norm.float()) for layer in self.layers] if row_ops else []
        self.final_norm_f32 = self.final_norm.float() if row_ops else None
        # A decode step's layer in one C++ call (decode_layer.py) where its linears allow
        self.fused_parts = decode_layer.LayerParts([(layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
                                                    for layer in self.layers]) if self.silu else None

    @property
    def takes_output_rows(self) -> bool:
        """Whether a step's last layer may compute only its read rows (output_rows.py): on the
        row-ops path, whose kernels compute each row alone."""
        return self.row_ops

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, head_dim] in the activations' dtype (LlamaRotaryEmbedding)."""
        freqs = positions[:, None].float() * self.inv_freq.float()  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        scaling = self.rope_scaling
        return (emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logit_rows: torch.Tensor,
                 meta: AttentionMetadata, feature_rows: torch.Tensor | None = None,
                 vocab_subsets: dict[int, torch.Tensor] | None = None, read: OutputRows | None = None):
        """-> logits [R, vocab]; with `feature_rows` [F] also (logits, features [F, hidden] after the
        final norm). `vocab_subsets` {logit row: allowed ids}: those rows over those ids only.
        `read`: the rows whose last-layer output is read (output_rows.py), taken by the row-ops path
        (`takes_output_rows`) where no features are asked for; the other paths compute every row."""
        embed = self.embed
        h = nn.functional.embedding(input_ids, embed.weight, embed.padding_idx)  # [T, hidden]
        cos, sin = self._cos_sin(position_ids, h.dtype)
        if self.row_ops:
            return self._call_row_ops(h, cos, sin, logit_rows, meta, feature_rows, vocab_subsets,
                                      read if feature_rows is None else None)
        num_tokens, eps, heads = h.shape[0], self.eps, self.num_heads
        for layer in self.layers:
            x = _rms_norm(h, layer.input_norm, eps)
            qkv = layer.qkv_proj(x)  # [T, q_size + 2 * kv_size]
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)  # [T, H + KV, D]
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            if layer.qk_norm is not None:
                qk = _rms_norm(qk, layer.qk_norm, eps)
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :heads].contiguous()  # [T, H, D]
            k = qk[:, heads:].contiguous()  # [T, KV, D]
            a = paged_attention(meta, layer.index, q, k, v.contiguous(), self.scaling, layer.sliding_window)
            h = h + layer.o_proj(a.reshape(num_tokens, -1))
            x = _rms_norm(h, layer.post_attention_norm, eps)
            gate_up = layer.gate_up_proj(x)  # [T, 2 * intermediate]
            h = h + layer.down_proj(self.act(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:])
        logits = self.output(_rms_norm(h.index_select(0, logit_rows), self.final_norm, eps), vocab_subsets)
        if feature_rows is None:
            return logits
        return logits, _rms_norm(h.index_select(0, feature_rows), self.final_norm, eps)  # the norm is per row

    def _call_row_ops(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, logit_rows: torch.Tensor,
                      meta: AttentionMetadata, feature_rows: torch.Tensor | None = None,
                      vocab_subsets: dict[int, torch.Tensor] | None = None, read: OutputRows | None = None):
        """The loop of __call__ through the C++ row ops: each residual add runs with the norm after
        it (the next layer's input norm, or the final norm, which is per row, so computing it on
        every row and selecting the logit rows after gives the same rows)."""
        eps = self.eps
        x = cpu_rowops.rms_norm(h, self.row_weights[0][0], eps, weight_after=True)
        fused = self.fused_parts(x.shape[0]) if self.fused_parts is not None else None  # per layer, or None: nine calls
        for i, layer in enumerate(self.layers):
            _, qk_norm, post_attention_norm = self.row_weights[i]
            next_norm = self.row_weights[i + 1][0] if i + 1 < len(self.layers) else self.final_norm_f32
            attention = decode_layer.LayerParts.attention(fused, read, i, meta, layer.index, self.head_dim,
                                                          layer.sliding_window)
            if attention is not None:  # every row a decode row: the layer in one C++ call
                h, x = decode_layer.decode_layer(x, h, fused[i], qk_norm, cos, sin, self.num_heads, self.num_kv_heads,
                                                 attention, self.scaling, None, post_attention_norm, None, next_norm,
                                                 eps, weight_after=True, gelu_tanh=False)
                continue
            qkv = layer.qkv_proj(x)  # [T, q_size + 2 * kv_size]
            q, k, v = cpu_rowops.qk_norm_rope(qkv, qk_norm, cos, sin, self.num_heads, self.num_kv_heads, eps,
                                              weight_after=True)
            last = read if i == len(self.layers) - 1 else None  # past its keys and values, only the rows read
            a, h, logit_rows = attend_rows(meta, last, layer.index, q, k, v, self.scaling, layer.sliding_window,
                                           h, logit_rows)
            a = layer.o_proj(a.flatten(1))  # [rows, H * D]
            h, x = cpu_rowops.add_rms_norm(h, a, None, post_attention_norm, eps, weight_after=True)
            gate_up = layer.gate_up_proj(x)  # [T, 2 * intermediate]
            if self.silu:
                d = layer.down_proj(cpu_rowops.silu_mul(gate_up))
            else:
                d = layer.down_proj(self.act(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:])
            h, x = cpu_rowops.add_rms_norm(h, d, None, next_norm, eps, weight_after=True)
        logits = self.output(x.index_select(0, logit_rows), vocab_subsets)  # [R, vocab]
        return logits if feature_rows is None else (logits, x.index_select(0, feature_rows))
