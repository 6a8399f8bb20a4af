// The int8 pass of cpu_argmax_screen.cpp on AVX2 (the SPECMESH_ISA_AVX2 build; included there only).
//
// A group's 16 columns are two halves of 8 (a 32-byte load of a quad is 8 columns x 4 k, each
// column's 4 k in one int32 lane, as the weights lie). Per quad and row: q = (q + 128) ^ 0x80 as
// int8, VPSIGNB gives q * sign(p), VPMADDUBSW multiplies by |p| and adds pairs in int16 (|sum| <=
// 2 * 127 * 127, no saturation), VPMADDWD against ones adds the two pairs: sum over the 4 k of q * p
// in int32, exactly. The epilogue per block and the bounds are the AVX-512 loop's, op for op, per
// column.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int kHalves = 2;  // 8-column vectors per group

inline float lanes_max(__m256 v, int64_t n) {  // the largest of the first n (<= 8) lanes
  const __m256 inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  return specmesh_simd::reduce_max(n >= 8 ? v : _mm256_blendv_ps(inf, v, _mm256_castsi256_ps(specmesh_simd::lane_mask(n))));
}

// One group's approximate logits of one row (two halves) -> its upper bounds (into upper) and the
// group's largest upper and lower bound for the row (into ext): write_bounds of the AVX-512 loop.
inline void write_bounds(const Screen& s, const Rows& r, int64_t g, int64_t row, const __m256 (&total)[kHalves],
                         float* upper, const Extremes& ext) {
  float hi = -std::numeric_limits<float>::infinity(), lo = hi;
  for (int h = 0; h < kHalves; ++h) {
    const int64_t c0 = g * kCols + 8 * h, n = specmesh_simd::tail(s.N - c0);
    if (n == 0) break;
    const __m256 err = specmesh_simd::load_ps(s.weight_err + c0, n);
    const __m256 norm = specmesh_simd::load_ps(s.weight_norm + c0, n);
    const __m256 bound = _mm256_fmadd_ps(_mm256_set1_ps(r.alpha[row]), err,
                                         _mm256_mul_ps(_mm256_set1_ps(r.beta[row]), norm));
    const __m256 up = _mm256_add_ps(total[h], bound);
    specmesh_simd::store_ps(upper + row * s.N + c0, up, n);
    hi = std::max(hi, lanes_max(up, n));
    lo = std::max(lo, lanes_max(_mm256_sub_ps(total[h], bound), n));
  }
  ext.upper[g * ext.M + row] = hi;
  ext.lower[g * ext.M + row] = lo;
}

// Rows m0 .. m0 + MB against groups g0 .. g0 + NG: upper bounds -> upper[m, 16g ...], each group's
// extremes per row -> ext.
template <int NG, int MB>
void group_rows(const Screen& s, const Rows& r, int64_t m0, int64_t g0, float* upper, const Extremes& ext) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[NG][MB][kHalves];
  for (int h = 0; h < NG; ++h)
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kHalves; ++v) total[h][m][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < s.blocks; ++b) {
    __m256i acc[NG][MB][kHalves];
    for (int h = 0; h < NG; ++h)
      for (int m = 0; m < MB; ++m)
        for (int v = 0; v < kHalves; ++v) acc[h][m][v] = _mm256_setzero_si256();
    for (int64_t j = 0; j < s.quads; ++j) {
      __m256i w[NG][kHalves];  // q as int8
      for (int h = 0; h < NG; ++h)
        for (int v = 0; v < kHalves; ++v)
          w[h][v] = _mm256_xor_si256(flip, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                               s.quants + ((g0 + h) * s.K4 + b * s.quads + j) * 64 + 32 * v)));
      for (int m = 0; m < MB; ++m) {
        int32_t quad;  // p[m, 4(quads b + j) .. + 3]
        std::memcpy(&quad, r.p + (m0 + m) * r.K + (b * s.quads + j) * 4, sizeof(quad));
        const __m256i xq = _mm256_set1_epi32(quad);
        const __m256i ax = _mm256_abs_epi8(xq);
        for (int h = 0; h < NG; ++h)
          for (int v = 0; v < kHalves; ++v) {
            const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[h][v], xq));  // int16
            acc[h][m][v] = _mm256_add_epi32(acc[h][m][v], _mm256_madd_epi16(pairs, ones));
          }
      }
    }
    for (int h = 0; h < NG; ++h)
      for (int v = 0; v < kHalves; ++v) {
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            s.scales + ((g0 + h) * s.blocks + b) * kCols + 8 * v)));
        for (int m = 0; m < MB; ++m) {
          const int64_t at = (m0 + m) * s.blocks + b;
          const __m256 sums = _mm256_cvtepi32_ps(acc[h][m][v]);
          total[h][m][v] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, _mm256_set1_ps(r.t[at])), total[h][m][v]);
        }
      }
  }
  for (int h = 0; h < NG; ++h)
    for (int m = 0; m < MB; ++m) write_bounds(s, r, g0 + h, m0 + m, total[h][m], upper, ext);
}

// The int8 pass over every row and group: two groups a pass for one row (two weight streams in
// flight), else one group and up to two rows a pass (16 vector registers: 4 int32 and 4 float32
// sums per row and group).
void loop_groups(const Screen& s, const Rows& r, int64_t M, int64_t G, float* up, const Extremes& ext) {
  const int64_t width = M == 1 ? 2 : 1;
  at::parallel_for(0, (G + width - 1) / width, 256 / width, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g0 = u * width;
      if (width == 2 && g0 + 1 < G) {
        group_rows<2, 1>(s, r, 0, g0, up, ext);
        continue;
      }
      for (int64_t g = g0; g < std::min(G, g0 + width); ++g)
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
          if (M - m0 >= 2) group_rows<1, 2>(s, r, m0, g, up, ext);
          else group_rows<1, 1>(s, r, m0, g, up, ext);
        }
    }
  });
}

}  // namespace
