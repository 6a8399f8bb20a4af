// The entry points of specmesh's CPU kernel module (specmesh_cpu_kernels): declared once here,
// defined in the file named above each group, bound to Python in cpu_kernels.cpp. Every file
// includes this header, so a definition that drifts from its declaration fails to compile.
// Shapes and semantics: the Python wrappers (cpu_linear.py, cpu_rowops.py).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

// cpu_linear.cpp: bf16 linear layers (AVX-512; VDPBF16PS where the CPU has AVX512-BF16).
at::Tensor pack_bf16_weight(const at::Tensor& w);  // [N, K] bf16 -> [ceil(N/32), ceil(K/2), 64] panels
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool dot);  // [M, K] -> [M, N]
int64_t few_row_panel_groups(int64_t P, int64_t widest, int64_t threads);  // bf16_linear's panels per group at 1-3 rows

// cpu_amx_linear.cpp: the same product over the same panels with AMX tiles (calls of many rows).
bool amx_ready();  // asks the OS for the tile registers once; whether it granted them
at::Tensor bf16_linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N);  // [M, K], K % 32 == 0

// cpu_gguf_linear.cpp: linear layers over GGUF block-quantized weights (AVX512-BF16), repacked
// by cpu_gguf_linear.py; bit-identical to bf16_linear over the weights dequantized to bf16.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t N, bool amx);  // [M, K] -> [M, N]
at::Tensor gguf_rows(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& offsets,
                     const at::Tensor& ids, int64_t N);  // rows ids [T] of the weight -> [T, K] bf16

// cpu_argmax_screen.cpp: int8 bounds on every logit of rows that only need the argmax (AVX512-VNNI),
// laid out by argmax_screen.py: (upper bound [M, N], best lower bound [M], the tokens that can win [C]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_screen(const at::Tensor& p, const at::Tensor& t, const at::Tensor& corr,
                                                 const at::Tensor& alpha, const at::Tensor& beta,
                                                 const at::Tensor& quants, const at::Tensor& scales,
                                                 const at::Tensor& weight_err, const at::Tensor& weight_norm,
                                                 int64_t N, double tie_margin, bool amx);

// cpu_argmax_rows.cpp: the greedy token of float32 logit rows, torch.argmax's answer where the row has
// no NaN and a finite largest value: (index [M] int64, ok [M] bool).
std::tuple<at::Tensor, at::Tensor> argmax_rows_f32(const at::Tensor& logits);

// cpu_rowops.cpp: the lean forwards' per-row ops between the matmuls (Gemma 3's and the Llama
// family's: weight_after picks the norm's rounding), bf16 activations.
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps, bool weight_after);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& h, const at::Tensor& a, const at::Tensor& w_a,
                                                     const at::Tensor& w_next, double eps, bool weight_after);
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_bf16(const at::Tensor& qkv, const at::Tensor& w,
                                                                 const at::Tensor& cos, const at::Tensor& sin,
                                                                 int64_t H, int64_t KV, double eps, bool weight_after);
at::Tensor gelu_tanh_mul_bf16(const at::Tensor& gate_up);
at::Tensor silu_mul_bf16(const at::Tensor& gate_up);
void masked_softmax_bf16_(at::Tensor& scores, const at::Tensor& hidden);

// cpu_decode_layer.cpp: one decoder layer of decode rows (the lean forward's nine calls) in one call.
std::tuple<at::Tensor, at::Tensor> decode_layer_bf16(
    const at::Tensor& x, const at::Tensor& h, const std::vector<at::Tensor>& linears,
    const std::vector<int64_t>& dims, bool dot, const at::Tensor& qk_norm, const at::Tensor& cos,
    const at::Tensor& sin, int64_t heads, int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& offsets,
    const at::Tensor& lens, const at::Tensor& masks, double scale, const at::Tensor& post_attention_norm,
    const at::Tensor& pre_feedforward_norm, const at::Tensor& post_feedforward_norm, const at::Tensor& next_norm,
    double eps, bool weight_after, bool gelu_tanh);

// cpu_decode_attention.cpp: single query rows over the paged bf16 pool, in place.
void decode_attention_bf16(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& offsets,
                           const at::Tensor& lens, const at::Tensor& masks, double scale, at::Tensor& out);
at::Tensor store_decode_attention_bf16(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                       at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                                       const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& offsets,
                                       const at::Tensor& lens, const at::Tensor& masks, double scale);

// cpu_chunk_attention.cpp: prefill chunks over the paged bf16 pool (AVX512-BF16), in place.
void chunk_attention_bf16(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& pieces, const at::Tensor& tables, const at::Tensor& bounds, double scale,
                          at::Tensor& out, bool amx);
