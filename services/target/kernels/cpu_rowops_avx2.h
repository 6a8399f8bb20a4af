// The AVX2 + FMA row loops of cpu_rowops.cpp (the SPECMESH_ISA_AVX2 build; included there only):
// the AVX-512 loops' arithmetic step for step, 8 lanes at a time. Only the sum of squares of a norm
// and a softmax's max and sum go through 8 lanes before the reduction across them (16 on AVX-512),
// an order that can move a value by one bf16 rounding step, as against torch.
#pragma once

#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using namespace specmesh_simd;

// 1 / sqrt(mean(x^2) + eps) of one row of D bf16 values.
inline float inv_rms(const uint16_t* x, int64_t D, float eps) {
  __m256 sq = _mm256_setzero_ps();
  for (int64_t j = 0; j < D; j += kWidth) {
    const __m256 v = load_bf16(x + j, tail(D - j));
    sq = _mm256_fmadd_ps(v, v, sq);
  }
  return 1.0f / std::sqrt(reduce_add(sq) / static_cast<float>(D) + eps);
}

// out[j] = bf16((x[j] * r) * w[j]), the rounding of torch.rms_norm(x.float(), w) .to(bf16).
inline void norm_row(const uint16_t* x, const float* w, float r, int64_t D, uint16_t* out) {
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t j = 0; j < D; j += kWidth) {
    const int64_t n = tail(D - j);
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(load_bf16(x + j, n), rv), load_ps(w + j, n));
    store_bf16(out + j, round_bf16(y), n);
  }
}

// The Llama family's RMSNorm: out[j] = bf16(bf16(x[j] * r) * w[j]) (as cpu_rowops.cpp's AVX-512 loop).
inline void norm_row_weight_after(const uint16_t* x, const float* w, float r, int64_t D, uint16_t* out) {
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t j = 0; j < D; j += kWidth) {
    const int64_t n = tail(D - j);
    const __m256 normed = round_bf16(_mm256_mul_ps(load_bf16(x + j, n), rv));
    store_bf16(out + j, round_bf16(_mm256_mul_ps(normed, load_ps(w + j, n))), n);
  }
}

// One row of a plain residual add (the Llama family's): hn[j] = bf16(h[j] + a[j]).
inline void add_row(const uint16_t* hr, const uint16_t* ar, int64_t D, uint16_t* hn) {
  for (int64_t j = 0; j < D; j += kWidth) {
    const int64_t n = tail(D - j);
    store_bf16(hn + j, round_bf16(_mm256_add_ps(load_bf16(hr + j, n), load_bf16(ar + j, n))), n);
  }
}

// One row of the SwiGLU activation: out[j] = bf16(bf16(silu(gate[j])) * up[j]), silu(x) = x / (1 + exp(-x)).
inline void silu_mul_row(const uint16_t* row, int64_t I, uint16_t* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t j = 0; j < I; j += kWidth) {
    const int64_t n = tail(I - j);
    const __m256 g = load_bf16(row + j, n);
    const __m256 act = round_bf16(_mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
    store_bf16(out + j, round_bf16(_mm256_mul_ps(act, load_bf16(row + I + j, n))), n);
  }
}

// GELU, tanh approximation, in torch's float32 formula (as cpu_rowops.cpp's AVX-512 gelu_tanh):
//   0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),  tanh(z) = 1 - 2 / (exp(2z) + 1)
inline __m256 gelu_tanh(__m256 x) {
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
  const __m256 e = exp_ps(_mm256_add_ps(inner, inner));
  const __m256 tanh = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), tanh));
}

// One row of the residual add: hn[j] = bf16(h[j] + bf16((a[j] * r) * w_a[j])).
inline void add_normed_row(const uint16_t* hr, const uint16_t* ar, const float* wa, float r_a, int64_t D, uint16_t* hn) {
  const __m256 ra = _mm256_set1_ps(r_a);
  for (int64_t j = 0; j < D; j += kWidth) {
    const int64_t n = tail(D - j);
    const __m256 normed = round_bf16(_mm256_mul_ps(_mm256_mul_ps(load_bf16(ar + j, n), ra), load_ps(wa + j, n)));
    store_bf16(hn + j, round_bf16(_mm256_add_ps(load_bf16(hr + j, n), normed)), n);
  }
}

// RoPE of one normed head (D values, D even) with its position's cos/sin rows:
//   y = bf16(bf16(n * cos) + bf16(rotate_half(n) * sin))
inline void rope_row(const uint16_t* normed, const uint16_t* cp, const uint16_t* sp, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  // rotate_half: -n[j + D/2] in the first half, n[j - D/2] in the second
  for (int side = 0; side < 2; ++side) {
    const int64_t lo = side * half, shift = side ? -half : half;
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(side ? 0 : static_cast<int>(0x80000000u)));
    for (int64_t j = lo; j < lo + half; j += kWidth) {
      const int64_t n = tail(lo + half - j);
      const __m256 x = load_bf16(normed + j, n);
      const __m256 rot = _mm256_xor_ps(load_bf16(normed + j + shift, n), sign);
      const __m256 a = round_bf16(_mm256_mul_ps(x, load_bf16(cp + j, n)));
      const __m256 b = round_bf16(_mm256_mul_ps(rot, load_bf16(sp + j, n)));
      store_bf16(out + j, round_bf16(_mm256_add_ps(a, b)), n);
    }
  }
}

// One row of the MLP's activation: out[j] = bf16(bf16(gelu_tanh(gate[j])) * up[j]), row = gate | up.
inline void gelu_mul_row(const uint16_t* row, int64_t I, uint16_t* out) {
  for (int64_t j = 0; j < I; j += kWidth) {
    const int64_t n = tail(I - j);
    const __m256 act = round_bf16(gelu_tanh(load_bf16(row + j, n)));
    store_bf16(out + j, round_bf16(_mm256_mul_ps(act, load_bf16(row + I + j, n))), n);
  }
}

// Lanes of 8 mask bytes (nonzero: hidden) that are hidden, all bits set; the first n (<= 8) only.
inline __m256 hidden_lanes(const uint8_t* h, int64_t n) {
  int64_t bytes = 0;
  std::memcpy(&bytes, h, n >= kWidth ? kWidth : n);
  const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()), _mm256_set1_epi32(-1)));
}

// One row of masked_softmax_bf16_ in place: s [N] bf16, h [N] (nonzero: hidden) or null, row [N]
// float32 scratch.
inline void softmax_row(uint16_t* s, const uint8_t* h, int64_t N, float* row) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  __m256 mxv = minus_inf;
  for (int64_t j = 0; j < N; j += kWidth) {
    const int64_t n = tail(N - j);
    __m256 x = _mm256_blendv_ps(minus_inf, load_bf16(s + j, n), _mm256_castsi256_ps(lane_mask(n)));  // -inf past N
    if (h != nullptr) x = _mm256_blendv_ps(x, minus_inf, hidden_lanes(h + j, n));
    store_ps(row + j, x, n);
    mxv = _mm256_max_ps(mxv, x);
  }
  const float mx = reduce_max(mxv);
  if (mx == -INFINITY) {  // sees nothing
    std::fill(s, s + N, uint16_t{0});
    return;
  }
  __m256 sum = _mm256_setzero_ps();
  const __m256 top = _mm256_set1_ps(mx);
  for (int64_t j = 0; j < N; j += kWidth) {
    const int64_t n = tail(N - j);
    const __m256 x = load_ps(row + j, n);
    // hidden entries (-inf) and lanes past N: exactly 0
    const __m256 live = _mm256_and_ps(_mm256_castsi256_ps(lane_mask(n)), _mm256_cmp_ps(x, minus_inf, _CMP_NEQ_OQ));
    const __m256 e = _mm256_and_ps(live, exp_ps(_mm256_sub_ps(x, top)));
    store_ps(row + j, e, n);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / reduce_add(sum));
  for (int64_t j = 0; j < N; j += kWidth) {
    const int64_t n = tail(N - j);
    store_bf16(s + j, round_bf16(_mm256_mul_ps(load_ps(row + j, n), inv)), n);
  }
}

}  // namespace
