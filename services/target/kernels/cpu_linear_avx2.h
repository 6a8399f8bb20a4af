// The AVX2 + FMA inner loops of cpu_linear.cpp (the SPECMESH_ISA_AVX2 build; included there only).
//
// Widen + FMA over the same packed panels as the AVX-512 loop: a 32-byte load of a [panel, k pair]
// is 8 columns' (2kk, 2kk+1) pairs (slots 16h .. 16h + 15 are columns 8h .. 8h + 7), a 16-bit shift
// gives the even k's as float32 and masking the low halves the odd k's. Each output is summed over
// k = 0 .. K-1 in order with FMA, as on AVX-512: the results are bit for bit the AVX-512 FMA
// loop's (and tests/target/test_cpu_linear.py's sequential reference), and batch-invariant.
// With 16 vector registers a tile holds at most 12 accumulators: one row over two panels
// (decode: twice the loads in flight), else up to three rows over one panel.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kVectors = 4;  // 8-lane float32 vectors per panel of 32 columns

// Rows of x ([MB, 2*K2] float32, row stride ldx) against panels p0 .. p0 + NP into out
// (panel-major, lpanel floats per panel, 32 per row).
template <int NP, int MB>
void fma_tile(const float* x, int64_t ldx, const uint16_t* packed, int64_t K2, int64_t p0, float* out,
              int64_t lpanel) {
  __m256 acc[NP][MB][kVectors];
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < kVectors; ++h) acc[p][m][h] = _mm256_setzero_ps();
  const __m256i odd_k = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* panel = packed + p0 * K2 * kPairSlots;
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int p = 0; p < NP; ++p) {
      const uint16_t* w = panel + (p * K2 + kk) * kPairSlots;
      for (int h = 0; h < kVectors; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * h));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));  // k = 2kk
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, odd_k));  // k = 2kk + 1
        for (int m = 0; m < MB; ++m) {
          acc[p][m][h] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * ldx + 2 * kk]), even, acc[p][m][h]);
          acc[p][m][h] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * ldx + 2 * kk + 1]), odd, acc[p][m][h]);
        }
      }
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < kVectors; ++h) _mm256_storeu_ps(out + p * lpanel + m * kPanel + 8 * h, acc[p][m][h]);
}

// Rows [0, M) against panels [p0, p0 + NP): tiles of MAX_MB rows, then one tile for the rest.
template <int NP, int MAX_MB>
void fma_rows(const float* x, int64_t ldx, int64_t M, int64_t K2, const uint16_t* packed, int64_t p0, float* buf,
              int64_t lpanel) {
  static_assert(MAX_MB >= 1 && MAX_MB <= 3, "at most 12 accumulators");
  int64_t m = 0;
  for (; m + MAX_MB <= M; m += MAX_MB) fma_tile<NP, MAX_MB>(x + m * ldx, ldx, packed, K2, p0, buf + m * kPanel, lpanel);
  const int64_t rest = M - m;
  if (rest == 1) fma_tile<NP, 1>(x + m * ldx, ldx, packed, K2, p0, buf + m * kPanel, lpanel);
  else if (rest == 2) fma_tile<NP, (MAX_MB >= 3 ? 2 : 1)>(x + m * ldx, ldx, packed, K2, p0, buf + m * kPanel, lpanel);
}

// buf's rows [0, rows) of panel p (32 float32 each) -> y[m, p * 32 ...] bf16 (row stride N), up to N.
inline void write_panel(const float* buf, int64_t rows, int64_t p, int64_t N, uint16_t* y) {
  const int64_t n0 = p * kPanel, valid = std::min<int64_t>(kPanel, N - n0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t h = 0; h < kVectors && 8 * h < valid; ++h)
      specmesh_simd::store_bf16(y + m * N + n0 + 8 * h, specmesh_simd::round_bf16(_mm256_loadu_ps(buf + m * kPanel + 8 * h)),
                                valid - 8 * h);
}

// From this many rows a panel is widened once into float32 and every row tile multiplies the widened
// copy: the tile's loop is then loads and FMAs only (measured here, 2-core Zen 3: 110-128 GFLOP/s
// widening in every tile against ~170 for MKL's float32 sgemm on the same shapes).
constexpr int64_t kWidenMinRows = 12;

// One panel's packed [K2, 64 slots] -> wf [2*K2, 32] float32: row 2kk the 32 columns' k = 2kk values,
// row 2kk + 1 their k = 2kk + 1 values (exact: bf16 widened).
inline void widen_panel(const uint16_t* panel, int64_t K2, float* wf) {
  const __m256i odd_k = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kk = 0; kk < K2; ++kk)
    for (int h = 0; h < kVectors; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + kk * kPairSlots + 16 * h));
      _mm256_storeu_ps(wf + 2 * kk * kPanel + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_storeu_ps(wf + (2 * kk + 1) * kPanel + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(v, odd_k)));
    }
}

// MB rows of x ([MB, K] float32, row stride ldx) against a widened panel wf [K, 32] -> out rows (32
// floats each). k in order with FMA per output, as fma_tile sums: the same bits.
template <int MB>
[[gnu::always_inline]] inline void widened_tile(const float* x, int64_t ldx, const float* wf, int64_t K, float* out) {
  __m256 acc[MB][kVectors];
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < kVectors; ++h) acc[m][h] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[MB];
    for (int m = 0; m < MB; ++m) b[m] = _mm256_broadcast_ss(x + m * ldx + k);
    for (int h = 0; h < kVectors; ++h) {
      const __m256 w = _mm256_loadu_ps(wf + k * kPanel + 8 * h);
      for (int m = 0; m < MB; ++m) acc[m][h] = _mm256_fmadd_ps(b[m], w, acc[m][h]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < kVectors; ++h) _mm256_storeu_ps(out + m * kPanel + 8 * h, acc[m][h]);
}

// Every row of x ([M, K] float32, contiguous) against a widened panel wf [K, 32] -> sums [M, 32].
// The row tiles are inlined (always_inline): where GCC 12 kept widened_tile<3> out of line (called
// from several instantiations), it stored the 12 sums to the stack every k, 2.5x slower.
inline void widened_rows(const float* x, int64_t M, int64_t K, const float* wf, float* sums) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) widened_tile<3>(x + m * K, K, wf, K, sums + m * kPanel);
  if (M - m == 2) widened_tile<2>(x + m * K, K, wf, K, sums + m * kPanel);
  else if (M - m == 1) widened_tile<1>(x + m * K, K, wf, K, sums + m * kPanel);
}

// x [M, 2*K2] float32 against the panels [P, K2, 64] -> y [M, N] bf16, each panel widened once
// (a thread's panels in turn; M >= kWidenMinRows).
inline void run_widened(const float* x, int64_t M, int64_t K2, const uint16_t* wp, int64_t P, int64_t N, uint16_t* y) {
  const int64_t K = 2 * K2;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(K * kPanel);  // [K, 32]: one panel widened
    std::vector<float> sums(M * kPanel);  // [M, 32]: its outputs, before rounding to bf16
    for (int64_t p = begin; p < end; ++p) {
      widen_panel(wp + p * K2 * kPairSlots, K2, wf.data());
      widened_rows(x, M, K, wf.data(), sums.data());
      write_panel(sums.data(), M, p, N, y);
    }
  });
}

// x [M, 2*K2] float32 (contiguous) times the panels [P, K2, 64] -> y [M, N] bf16.
inline void run_fma(const float* x, int64_t M, int64_t K2, const uint16_t* wp, int64_t P, int64_t N, uint16_t* y) {
  if (M >= kWidenMinRows) return run_widened(x, M, K2, wp, P, N, y);
  const int64_t ldx = 2 * K2;
  const int64_t np = M == 1 ? 2 : 1;  // panels per tile (see the top of this file)
  const int64_t m_chunk = 96;  // rows per pass over a thread's panels (their x stays in L2)
  at::parallel_for(0, (P + np - 1) / np, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> block(np * std::min(m_chunk, M) * kPanel);  // [np, rows, 32]: whole-vector stores, then y
    for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
      const int64_t rows_here = std::min(m_chunk, M - m0), lpanel = rows_here * kPanel;
      const float* xm = x + m0 * ldx;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * np, panels = std::min(np, P - p0);
        if (panels == 2) fma_rows<2, 1>(xm, ldx, rows_here, K2, wp, p0, block.data(), lpanel);
        else fma_rows<1, 3>(xm, ldx, rows_here, K2, wp, p0, block.data(), lpanel);
        for (int64_t p = 0; p < panels; ++p) write_panel(block.data() + p * lpanel, rows_here, p0 + p, N, y + m0 * N);
      }
    }
  });
}

}  // namespace
