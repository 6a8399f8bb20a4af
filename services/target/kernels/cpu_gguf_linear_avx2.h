// The AVX2 + FMA loops of cpu_gguf_linear.cpp (the SPECMESH_ISA_AVX2 build; included there only).
//
// On AVX2 bf16_linear widens each bf16 weight to float32 and sums every output over k = 0 .. K-1 in
// order with FMA (cpu_linear_avx2.h). These loops expand each GGUF weight to the same float32 value,
// round_bf16(S * q - D) widened, and make the same FMAs in the same order: every output equals
// bf16_linear's over the dequantized weight bit for bit.
//
// S * q is exact in float32 for every served type (an fp16 scale times at most 7 + 6 bits of
// integers: <= 24 significant bits), so FMSUB(q, S, D) rounds S * q - D once, as the reference's
// multiply then subtract does. There is no VCVTNE2PS2BF16 on AVX2: the rounding to bf16 is the
// integer one (specmesh_simd::round_bf16_finite: no weight is NaN, the scales being finite).
//
// The layout is the AVX-512 kernel's (cpu_gguf_linear.py packs it once for both): a group's 16
// bytes at [g, kk] (int8) hold 8 columns' (2kk, 2kk + 1) pairs, widened to 16-bit lanes a 32-bit
// lane per column, low half k = 2kk, high half 2kk + 1; so each column's even and odd k come apart
// by a shift, and one vector of 8 scales serves both.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// kGroup and Weights (the layout): cpu_gguf_linear.cpp, before this file's include.

// S (and D) of sub-block sb of group g: [0] for columns 0-7, [1] for 8-15.
struct SubScales {
  __m256 s[2], d[2];
};

inline SubScales sub_scales(const Weights& w, int64_t g, int64_t sb) {
  const int64_t at = (g * w.subs + sb) * kGroup;
  SubScales out{{_mm256_loadu_ps(w.scales + at), _mm256_loadu_ps(w.scales + at + 8)},
                {_mm256_setzero_ps(), _mm256_setzero_ps()}};
  if (w.offsets != nullptr) {
    out.d[0] = _mm256_loadu_ps(w.offsets + at);
    out.d[1] = _mm256_loadu_ps(w.offsets + at + 8);
  }
  return out;
}

template <bool OFFSETS>
inline __m256 value(__m256i q, __m256 s, __m256 d) {  // round_bf16(S * q - D), 8 columns
  const __m256 qf = _mm256_cvtepi32_ps(q);
  return specmesh_simd::round_bf16_finite(OFFSETS ? _mm256_fmsub_ps(qf, s, d) : _mm256_mul_ps(qf, s));
}

// Group g's weights at k = 2kk (v[0] columns 0-7, v[1] columns 8-15) and k = 2kk + 1 (v[2], v[3]).
template <bool OFFSETS, bool NIB>
inline void expand(const Weights& w, int64_t g, int64_t kk, const SubScales& s, __m256 (&v)[4]) {
  __m256i even[2], odd[2];
  if (NIB) {  // byte i: the int8 layout's byte i (low nibble) and byte 16 + i (high nibble)
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.quants + (g * w.K2 + kk) * kGroup)));
    const __m256i nib = _mm256_set1_epi32(0x0F);
    even[0] = _mm256_and_si256(b, nib);
    odd[0] = _mm256_and_si256(_mm256_srli_epi32(b, 16), nib);
    even[1] = _mm256_and_si256(_mm256_srli_epi32(b, 4), nib);
    odd[1] = _mm256_srli_epi32(b, 20);
  } else {
    const int8_t* q = w.quants + (g * w.K2 + kk) * 2 * kGroup;
    for (int h = 0; h < 2; ++h) {
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
      even[h] = _mm256_srai_epi32(_mm256_slli_epi32(b, 16), 16);
      odd[h] = _mm256_srai_epi32(b, 16);
    }
  }
  for (int h = 0; h < 2; ++h) {
    v[h] = value<OFFSETS>(even[h], s.s[h], s.d[h]);
    v[2 + h] = value<OFFSETS>(odd[h], s.s[h], s.d[h]);
  }
}

// Decode rows: MB rows of x ([MB, 2*K2] float32, row stride ldx) against groups g0 .. g0 + NG, each
// weight expanded once for all rows. Sums -> out[m * 32 + p * 16] (rows of a panel, as write_panel takes them).
template <int NG, int MB, bool OFFSETS, bool NIB>
void register_tile(const float* x, int64_t ldx, const Weights& w, int64_t g0, float* out) {
  __m256 acc[NG][MB][2];
  for (int p = 0; p < NG; ++p)
    for (int m = 0; m < MB; ++m) acc[p][m][0] = acc[p][m][1] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < w.subs; ++sb) {
    SubScales s[NG];
    for (int p = 0; p < NG; ++p) s[p] = sub_scales(w, g0 + p, sb);
    for (int64_t kk = sb * w.sub_pairs; kk < (sb + 1) * w.sub_pairs; ++kk) {
      for (int p = 0; p < NG; ++p) {
        __m256 v[4];
        expand<OFFSETS, NIB>(w, g0 + p, kk, s[p], v);
        for (int m = 0; m < MB; ++m) {
          const __m256 x0 = _mm256_broadcast_ss(x + m * ldx + 2 * kk), x1 = _mm256_broadcast_ss(x + m * ldx + 2 * kk + 1);
          for (int h = 0; h < 2; ++h) acc[p][m][h] = _mm256_fmadd_ps(x1, v[2 + h], _mm256_fmadd_ps(x0, v[h], acc[p][m][h]));
        }
      }
    }
  }
  for (int p = 0; p < NG; ++p)
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * kPanel + p * kGroup + 8 * h, acc[p][m][h]);
}

// Groups g0 .. g0 + groups (at most 2) expanded to float32 wf [K, 32]: row k the 32 columns' values
// (cpu_linear_avx2.h's widened panel; columns past the groups zero).
template <bool OFFSETS, bool NIB>
void expand_widened(const Weights& w, int64_t g0, int64_t groups, float* wf) {
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t sb = 0; sb < w.subs; ++sb) {
      const SubScales s = h < groups ? sub_scales(w, g0 + h, sb) : SubScales{};
      for (int64_t kk = sb * w.sub_pairs; kk < (sb + 1) * w.sub_pairs; ++kk) {
        __m256 v[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        if (h < groups) expand<OFFSETS, NIB>(w, g0 + h, kk, s, v);
        for (int e = 0; e < 2; ++e)  // e: k = 2kk + e
          for (int c = 0; c < 2; ++c) _mm256_storeu_ps(wf + (2 * kk + e) * kPanel + h * kGroup + 8 * c, v[2 * e + c]);
      }
    }
}

// x [M, 2*K2] float32 (contiguous) -> y [M, N] bf16.
template <bool OFFSETS, bool NIB>
void run(const float* x, int64_t M, const Weights& w, int64_t G, int64_t N, uint16_t* y) {
  const int64_t ldx = 2 * w.K2, K = 2 * w.K2;
  if (M <= 3) {  // decode: two groups a pass (one at 3 rows), so sums, scales and weights fit 16 registers
    at::parallel_for(0, (G + 1) / 2, 8, [&](int64_t begin, int64_t end) {
      float buf[3 * kPanel];  // [M, 32]: the pass's two groups, row by row
      for (int64_t u = begin; u < end; ++u) {
        const int64_t g0 = u * 2, groups = std::min<int64_t>(2, G - g0);
        if (groups == 2 && M == 1) register_tile<2, 1, OFFSETS, NIB>(x, ldx, w, g0, buf);
        else if (groups == 2 && M == 2) register_tile<2, 2, OFFSETS, NIB>(x, ldx, w, g0, buf);
        else
          for (int64_t p = 0; p < groups; ++p) {
            if (M == 1) register_tile<1, 1, OFFSETS, NIB>(x, ldx, w, g0 + p, buf + p * kGroup);
            else if (M == 2) register_tile<1, 2, OFFSETS, NIB>(x, ldx, w, g0 + p, buf + p * kGroup);
            else register_tile<1, 3, OFFSETS, NIB>(x, ldx, w, g0 + p, buf + p * kGroup);
          }
        write_panel(buf, M, u, N, y);  // groups 2u, 2u + 1 are panel u of bf16_linear's layout
      }
    });
    return;
  }
  // More rows: two groups (32 columns) widened to float32 once, then bf16_linear's widened rows.
  at::parallel_for(0, (G + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(K * kPanel);  // [K, 32]
    std::vector<float> sums(M * kPanel);  // [M, 32]
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g0 = u * 2, groups = std::min<int64_t>(2, G - g0);
      expand_widened<OFFSETS, NIB>(w, g0, groups, wf.data());
      widened_rows(x, M, K, wf.data(), sums.data());
      write_panel(sums.data(), M, u, N, y);
    }
  });
}

// Row n of the weight as bf16 [K]: its group widened, column n's values kept.
template <bool OFFSETS, bool NIB>
void expand_row(const Weights& w, int64_t n, uint16_t* out) {
  const int64_t g = n / kGroup, c = n % kGroup;
  alignas(32) float v[4][8];
  for (int64_t sb = 0; sb < w.subs; ++sb) {
    const SubScales s = sub_scales(w, g, sb);
    for (int64_t kk = sb * w.sub_pairs; kk < (sb + 1) * w.sub_pairs; ++kk) {
      __m256 e[4];
      expand<OFFSETS, NIB>(w, g, kk, s, e);
      for (int i = 0; i < 4; ++i) _mm256_store_ps(v[i], e[i]);
      for (int j = 0; j < 2; ++j) {  // k = 2kk + j: exact bf16 values, their high halves
        uint32_t bits;
        std::memcpy(&bits, &v[2 * j + c / 8][c % 8], sizeof(bits));
        out[2 * kk + j] = static_cast<uint16_t>(bits >> 16);
      }
    }
  }
}

}  // namespace
