// One decoder layer of decode rows in one call: the lean forwards' row-ops loop (`_call_row_ops` of
// gemma3_forward.py and llama_forward.py) for a step whose rows all attend as decode rows. The same
// kernels with the same arguments in the same order as that loop's nine calls, so the same bits;
// what it saves is the Python between them (the calls, their wrappers and the GIL's hand-offs:
// decode_layer.py says when the lean forward takes it).

#include <torch/extension.h>

#include "cpu_kernels.h"

#include <tuple>
#include <vector>

namespace {

// Linear i of the layer (0 qkv, 1 o, 2 gate|up, 3 down): parts[4i .. 4i + 3] = GGUF quants, scales,
// offsets and bf16 panels; non-empty quants multiply the blocks (gguf_linear), else the panels
// (bf16_linear). The caller picks per step what the layer's own module would (decode_layer.py).
// dims[2i], dims[2i + 1]: its outputs and inputs. Inputs past K (the rows' width): the panels carry a
// bias as input column K (AVX512LinearBF16, Qwen2's q/k/v), so x gets that column of ones and zeros up
// to the inputs, as the module's forward builds it.
at::Tensor linear_rows(const at::Tensor& x, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& dims,
                       size_t i, bool dot) {
  const int64_t N = dims[2 * i], K = x.size(1), extended = dims[2 * i + 1];
  const at::Tensor& quants = parts[4 * i];
  if (quants.numel() > 0) return gguf_linear(x, quants, parts[4 * i + 1], parts[4 * i + 2], N, /*amx=*/false);
  if (extended == K) return bf16_linear(x, parts[4 * i + 3], N, dot);
  TORCH_CHECK(extended > K, "decode_layer_bf16: linear ", i, " takes ", extended, " inputs, the rows have ", K);
  at::Tensor ext = at::zeros({x.size(0), extended}, x.options());  // [rows, K'] = [x | 1 | 0 ...]
  ext.narrow(1, 0, K).copy_(x);
  ext.select(1, K).fill_(1.0);
  return bf16_linear(ext, parts[4 * i + 3], N, dot);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layer_bf16(
    const at::Tensor& x, const at::Tensor& h, const std::vector<at::Tensor>& linears,
    const std::vector<int64_t>& dims, bool dot, const at::Tensor& qk_norm, const at::Tensor& cos,
    const at::Tensor& sin, int64_t heads, int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& offsets,
    const at::Tensor& lens, const at::Tensor& masks, double scale, const at::Tensor& post_attention_norm,
    const at::Tensor& pre_feedforward_norm, const at::Tensor& post_feedforward_norm, const at::Tensor& next_norm,
    double eps, bool weight_after, bool gelu_tanh) {
  TORCH_CHECK(linears.size() == 16 && dims.size() == 8,
              "decode_layer_bf16: 4 linears of 4 parts each (quants, scales, offsets, panels) and of 2 sizes each "
              "(outputs, inputs) expected");
  const at::Tensor qkv = linear_rows(x, linears, dims, 0, dot);  // [T, (H + 2 KV) * D]
  const auto [q, k, v] = qk_norm_rope_bf16(qkv, qk_norm, cos, sin, heads, kv_heads, eps, weight_after);
  const at::Tensor attn = store_decode_attention_bf16(q, k, v, k_cache, v_cache, slots, rows, tables, offsets, lens,
                                                      masks, scale);  // [T, H, D]
  const at::Tensor o = linear_rows(attn.flatten(1), linears, dims, 1, dot);  // [T, hidden]
  const auto [h_mid, x_mid] = add_rms_norm_bf16(h, o, post_attention_norm, pre_feedforward_norm, eps, weight_after);
  const at::Tensor gate_up = linear_rows(x_mid, linears, dims, 2, dot);  // [T, 2I]
  const at::Tensor act = gelu_tanh ? gelu_tanh_mul_bf16(gate_up) : silu_mul_bf16(gate_up);  // [T, I]
  const at::Tensor down = linear_rows(act, linears, dims, 3, dot);  // [T, hidden]
  return add_rms_norm_bf16(h_mid, down, post_feedforward_norm, next_norm, eps, weight_after);
}
