// The AVX2 + FMA loops of cpu_decode_attention.cpp (the SPECMESH_ISA_AVX2 build; included there
// only): the AVX-512 loops' arithmetic, 8 lanes at a time. Scores sum q.k over 8 lanes before
// the reduction across them (16 on AVX-512); the softmax and the weighted values are the same
// float32 steps. The entry point checks head_dim % 16 == 0, so no loop here has a tail but the
// softmax's over a row's entries.
#pragma once

#include <immintrin.h>

#include "cpu_simd.h"

#include <cmath>
#include <cstdint>

namespace {

using namespace specmesh_simd;

// n bf16 values (n a multiple of 8) -> float32 (exact).
inline void widen_row(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; d += kWidth) _mm256_storeu_ps(dst + d, load_bf16(src + d));
}

// The bf16 scores of G query heads (qf [G, D] float32) against one key row: scale * q.k, float32
// sums, rounded to bf16; written to out[g * stride].
template <int G>
inline void head_scores(const float* qf, const uint16_t* krow, int64_t D, float scale, float* out, int64_t stride) {
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += kWidth) {
    const __m256 k = load_bf16(krow + d);
    for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), k, acc[g]);
  }
  for (int g = 0; g < G; ++g) out[g * stride] = _mm256_cvtss_f32(round_bf16(_mm256_set1_ps(reduce_add(acc[g]) * scale)));
}

// out[g, d .. d + 8 C) = bf16(sum_j probs[g, j] v_j[d ..]) for G heads (probs [G, len], a null
// vrows[j] skipped); each value row is widened once for the G heads.
template <int G, int C>
inline void weighted_values(const float* probs, int64_t len, const uint16_t* const* vrows, int64_t d,
                            uint16_t* out, int64_t D) {
  __m256 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    if (vrows[j] == nullptr) continue;
    __m256 v[C];
    for (int c = 0; c < C; ++c) v[c] = load_bf16(vrows[j] + d + kWidth * c);
    for (int g = 0; g < G; ++g) {
      const __m256 p = _mm256_set1_ps(probs[g * len + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store_bf16(out + g * D + d + kWidth * c, round_bf16(acc[g][c]));
}

template <int G>
void head_block_scores(const float* qf, const uint16_t* const* krows, int64_t len, int64_t D, float scale,
                       float* probs) {
  for (int64_t j = 0; j < len; ++j)
    if (krows[j] != nullptr) head_scores<G>(qf, krows[j], D, scale, probs + j, len);
}

template <int G>
void head_block_values(const float* probs, int64_t len, const uint16_t* const* vrows, uint16_t* out, int64_t D) {
  // 16 columns a pass: 4 heads x 2 vectors = 8 accumulators of the 16 registers
  for (int64_t d = 0; d < D; d += 2 * kWidth) weighted_values<G, 2>(probs, len, vrows, d, out, D);
}

// Softmax of one head's scores in place (float32; -inf entries become 0), rounded to bf16.
inline void softmax_row(float* p, int64_t len) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  __m256 mx = minus_inf;
  for (int64_t j = 0; j < len; j += kWidth) {  // a masked load: never past the row's end
    const int64_t n = tail(len - j);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(minus_inf, load_ps(p + j, n), _mm256_castsi256_ps(lane_mask(n))));
  }
  const __m256 top = _mm256_set1_ps(reduce_max(mx));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; j += kWidth) {
    const int64_t n = tail(len - j);
    const __m256 x = load_ps(p + j, n);
    const __m256 live = _mm256_and_ps(_mm256_castsi256_ps(lane_mask(n)), _mm256_cmp_ps(x, minus_inf, _CMP_NEQ_OQ));
    const __m256 e = _mm256_and_ps(live, exp_ps(_mm256_sub_ps(x, top)));
    store_ps(p + j, e, n);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / reduce_add(sum));
  for (int64_t j = 0; j < len; j += kWidth) {
    const int64_t n = tail(len - j);
    store_ps(p + j, round_bf16(_mm256_mul_ps(load_ps(p + j, n), inv)), n);
  }
}

}  // namespace
