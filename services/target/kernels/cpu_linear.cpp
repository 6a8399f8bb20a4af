// bf16 linear layers on AVX-512 and AVX2 CPUs: y[M, N] = x[M, K] @ w[N, K]^T, x and w in bf16, products
// and sums in float32, y rounded once to bf16 (round to nearest even), as torch's bf16 linear.
//
// Two inner loops read the same packed weights:
// - widen + FMA (any AVX-512 CPU; the AVX2 build's only loop, cpu_linear_avx2.h): each bf16 is widened to float32 and multiplied-added; a
//   bf16 x bf16 product is exact in float32, and each output is summed over k = 0 .. K-1 in
//   order, so the result is reproducible in plain torch (tests/test_cpu_linear.py).
// - VDPBF16PS (CPUs with AVX512-BF16): one instruction multiplies two k's of 16 columns and adds
//   both products to float32 sums: half the instructions of widen + FMA. Sums run over the k
//   pairs in order; the hardware adds a pair's two products in its own order.
// Either way a row's outputs do not depend on the other rows of the call (batch-invariant):
// every row runs the same instructions over the same k order whatever M or the tiling.
//
// Why: where oneDNN emulates bf16 it is several times slower than widen + FMA; where it has
// AVX512-BF16 its one-row (decode) path streams the weights slower than this kernel
// (benchmarks/linear_formats.py; numbers: docs/kernels.md).
//
// Layout: weights packed once into panels of 32 output columns and pairs of k (cpu_panels.h; K padded
// with a zero to even). One 64-byte load is then 16 columns' pairs: the operand VDPBF16PS takes, and
// for widen + FMA a 16-bit shift gives the even k's as float32 and masking the low halves the odd k's.
// Where the CPU has AMX, calls of 3 or more rows go to cpu_amx_linear.cpp over the same panels
// (cpu_linear.py picks).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_panels.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using specmesh_panels::kPairSlots;
using specmesh_panels::kPanel;

}  // namespace

// The panels per group (`widest`, a power of two, or a narrower one) that split P panels most
// evenly over `threads`. A few-row call streams its weights, so the thread with the most panels
// sets its time: 640 outputs (20 panels) in groups of 8 are 3 groups, which one thread streamed
// alone (fewer than parallel_for's grain) and at best 16 + 4; in groups of 2, 10 + 10 (the default
// model's o_proj and down_proj at one row: 29 -> 17 and 71 -> 34 us on the AVX512-BF16 EPYC).
// Narrower groups keep fewer loads in flight, so one wins only where it unloads the busiest thread.
int64_t few_row_panel_groups(int64_t P, int64_t widest, int64_t threads) {
  int64_t best = widest, best_panels = P + 1;
  for (int64_t np = widest; np >= 1; np /= 2) {
    const int64_t groups = (P + np - 1) / np, busiest = std::min(P, (groups + threads - 1) / threads * np);
    if (busiest < best_panels) best_panels = busiest, best = np;
  }
  return best;
}

#if defined(SPECMESH_ISA_AVX2)
#include "cpu_linear_avx2.h"  // run_fma: the AVX2 + FMA loop
#else  // SPECMESH_ISA_AVX512

namespace {

// Stores acc[p][m][0..1] into buf[p * lpanel + m * 32 + 0..31] (a thread's panel-major block).
template <int NP, int MB>
inline void store(__m512 (&acc)[NP][MB][2], float* buf, int64_t lpanel) {
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m) {
      _mm512_storeu_ps(buf + p * lpanel + m * kPanel, acc[p][m][0]);
      _mm512_storeu_ps(buf + p * lpanel + m * kPanel + 16, acc[p][m][1]);
    }
}

// Widen + FMA: rows of x ([MB, 2*K2] float32, row stride ldx) against panels p0 .. p0 + NP.
template <int NP, int MB>
inline void fma_tile(const void* xv, int64_t ldx, const uint16_t* packed, int64_t K2, int64_t p0,
                     float* out, int64_t lpanel, bool /*prefetch: measured on AVX512-BF16 only*/) {
  const float* x = static_cast<const float*>(xv);
  __m512 acc[NP][MB][2];
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m) acc[p][m][0] = acc[p][m][1] = _mm512_setzero_ps();
  const __m512i odd_k = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* panel = packed + p0 * K2 * kPairSlots;
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int p = 0; p < NP; ++p) {
      const uint16_t* w = panel + (p * K2 + kk) * kPairSlots;
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(w + 32 * h);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));  // k = 2kk
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, odd_k));  // k = 2kk + 1
        for (int m = 0; m < MB; ++m) {
          acc[p][m][h] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + 2 * kk]), even, acc[p][m][h]);
          acc[p][m][h] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + 2 * kk + 1]), odd, acc[p][m][h]);
        }
      }
    }
  }
  store<NP, MB>(acc, out, lpanel);
}

constexpr int kPrefetchRows = 4;     // a tile of this many rows or more prefetches (dot_tile)
constexpr int64_t kPrefetchGroups = 2;  // how far ahead: in tiles' panel groups (1-4 measured alike, 8 slower)

// VDPBF16PS: rows of x ([MB, 2*K2] bf16, row stride ldx) against panels p0 .. p0 + NP.
template <int NP, int MB>
SPECMESH_DOT_TARGET inline void dot_tile(const void* xv, int64_t ldx, const uint16_t* packed, int64_t K2,
                                         int64_t p0, float* out, int64_t lpanel, bool prefetch) {
  const uint16_t* x = static_cast<const uint16_t*>(xv);
  __m512 acc[NP][MB][2];
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m) acc[p][m][0] = acc[p][m][1] = _mm512_setzero_ps();
  const uint16_t* panel = packed + p0 * K2 * kPairSlots;
  // A tile of many rows is compute-bound: while it runs, the weights of the tile kPrefetchGroups
  // groups on come in from memory, so the stream and the arithmetic overlap (the lm_head at 18
  // rows: 10.4 -> 6.9 ms on the AVX512-BF16 EPYC). Tiles of 1-3 rows stream at memory speed
  // already (prefetching there measured slower). A prefetch past the weights' end is harmless.
  const char* ahead = reinterpret_cast<const char*>(panel + kPrefetchGroups * NP * K2 * kPairSlots);
  for (int64_t kk = 0; kk < K2; ++kk) {
    if (prefetch)
      for (int p = 0; p < NP; ++p) {
        _mm_prefetch(ahead + (p * K2 + kk) * kPairSlots * 2, _MM_HINT_T0);
        _mm_prefetch(ahead + (p * K2 + kk) * kPairSlots * 2 + 64, _MM_HINT_T0);
      }
    __m512bh w[NP][2];  // 16 columns' (2kk, 2kk + 1) pairs each
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h)
        w[p][h] = (__m512bh)_mm512_loadu_si512(panel + (p * K2 + kk) * kPairSlots + 32 * h);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;  // x[m, 2kk], x[m, 2kk + 1]
      std::memcpy(&pair, x + m * ldx + 2 * kk, sizeof(pair));
      const __m512bh xpair = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p)
        for (int h = 0; h < 2; ++h) acc[p][m][h] = _mm512_dpbf16_ps(acc[p][m][h], w[p][h], xpair);
    }
  }
  store<NP, MB>(acc, out, lpanel);
}

using Tile = void (*)(const void*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, bool);

// Rows [0, M) of x (element size esize, row stride ldx) against panels [p0, p0 + NP) into buf
// (panel-major, lpanel floats per panel): tiles of MAX_MB rows, then one tile for the rest.
template <int NP, int MAX_MB, bool DOT>
void rows(const char* x, int64_t esize, int64_t ldx, int64_t M, int64_t K2, const uint16_t* packed, int64_t p0,
          float* buf, int64_t lpanel, bool prefetch) {
  constexpr Tile tiles[12] = {
      nullptr,
      DOT ? &dot_tile<NP, 1> : &fma_tile<NP, 1>, DOT ? &dot_tile<NP, 2> : &fma_tile<NP, 2>,
      DOT ? &dot_tile<NP, 3> : &fma_tile<NP, 3>, DOT ? &dot_tile<NP, (4 <= MAX_MB ? 4 : 1)> : &fma_tile<NP, (4 <= MAX_MB ? 4 : 1)>,
      DOT ? &dot_tile<NP, (5 <= MAX_MB ? 5 : 1)> : &fma_tile<NP, (5 <= MAX_MB ? 5 : 1)>,
      DOT ? &dot_tile<NP, (6 <= MAX_MB ? 6 : 1)> : &fma_tile<NP, (6 <= MAX_MB ? 6 : 1)>,
      DOT ? &dot_tile<NP, (7 <= MAX_MB ? 7 : 1)> : &fma_tile<NP, (7 <= MAX_MB ? 7 : 1)>,
      DOT ? &dot_tile<NP, (8 <= MAX_MB ? 8 : 1)> : &fma_tile<NP, (8 <= MAX_MB ? 8 : 1)>,
      DOT ? &dot_tile<NP, (9 <= MAX_MB ? 9 : 1)> : &fma_tile<NP, (9 <= MAX_MB ? 9 : 1)>,
      DOT ? &dot_tile<NP, (10 <= MAX_MB ? 10 : 1)> : &fma_tile<NP, (10 <= MAX_MB ? 10 : 1)>,
      DOT ? &dot_tile<NP, (11 <= MAX_MB ? 11 : 1)> : &fma_tile<NP, (11 <= MAX_MB ? 11 : 1)>,
  };
  int64_t m = 0;
  const Tile full = DOT ? &dot_tile<NP, MAX_MB> : &fma_tile<NP, MAX_MB>;
  // Only the first tile prefetches: the later ones read the same panels, already in cache.
  for (; m + MAX_MB <= M; m += MAX_MB)
    full(x + m * ldx * esize, ldx, packed, K2, p0, buf + m * kPanel, lpanel, prefetch && m == 0 && MAX_MB >= kPrefetchRows);
  if (M > m)
    tiles[M - m](x + m * ldx * esize, ldx, packed, K2, p0, buf + m * kPanel, lpanel,
                 prefetch && m == 0 && M - m >= kPrefetchRows);
}

template <bool DOT>
void run(const char* x, int64_t esize, int64_t M, int64_t K2, const uint16_t* wp, int64_t P, int64_t N,
         uint16_t* y) {
  const int64_t ldx = 2 * K2;
  // Few rows stream the weights (memory-bound): several panels per pass keep more loads and
  // independent chains in flight. With VDPBF16PS, up to 24 rows take one panel at a time in
  // tiles of up to 12 rows, so the first tile's pass over the weights from memory overlaps its
  // own arithmetic (the 262k-row lm_head at 11 rows: 11.9 ms against 18.3 with two 2-panel
  // tiles, one streaming and one computing); past that, 2-panel tiles of 6 rows reuse each
  // weight vector best. FMA needs registers for the widened weights: 12-row tiles of one panel.
  int64_t np = DOT ? (M == 1 ? 8 : M <= 3 ? 4 : M <= 24 ? 1 : 2) : M <= 3 ? 4 : M <= 6 ? 2 : 1;
  int64_t grain = 4;
  if (M <= 3) {  // streaming: every thread an equal share, however few the groups
    np = few_row_panel_groups(P, np, at::get_num_threads());
    grain = 1;
  }
  const int64_t m_chunk = 96;  // rows per pass over a thread's panels (their x stays in L2)
  at::parallel_for(0, (P + np - 1) / np, grain, [&](int64_t begin, int64_t end) {
    // The float32 sums of one panel group, panel-major ([np, rows, 32]): written by the tiles in
    // whole vectors, then rounded into y. Writing y's rows directly strided by N, a power of two
    // for the lm_head, made the tiles' stores collide in the caches.
    std::vector<float> block(np * std::min(m_chunk, M) * kPanel);
    for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
      const int64_t rows_here = std::min(m_chunk, M - m0), lpanel = rows_here * kPanel;
      const char* xm = x + m0 * ldx * esize;
      const bool prefetch = m0 == 0;  // later passes find the thread's panels in cache (L2 / L3)
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * np;
        const int64_t panels = std::min(np, P - p0);
        if (panels == 8) rows<8, 1, DOT>(xm, esize, ldx, rows_here, K2, wp, p0, block.data(), lpanel, prefetch);
        else if (panels == 4) rows<4, 3, DOT>(xm, esize, ldx, rows_here, K2, wp, p0, block.data(), lpanel, prefetch);
        else if (panels == 2) rows<2, 6, DOT>(xm, esize, ldx, rows_here, K2, wp, p0, block.data(), lpanel, prefetch);
        else
          for (int64_t p = 0; p < panels; ++p)
            rows<1, 12, DOT>(xm, esize, ldx, rows_here, K2, wp, p0 + p, block.data() + p * lpanel, lpanel, prefetch);
        for (int64_t p = 0; p < panels; ++p)
          specmesh_panels::write_panel(block.data() + p * lpanel, rows_here, p0 + p, N, y + m0 * N);
      }
    }
  });
}

}  // namespace

#endif  // SPECMESH_ISA_AVX512

// w: [N, K] bf16 -> [ceil(N / 32), ceil(K / 2), 64] bf16 panels (zeros past N and K).
at::Tensor pack_bf16_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kBFloat16, "pack_bf16_weight: bf16 [N, K] expected");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  at::Tensor packed = at::zeros({P, K2, kPairSlots}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
        const int64_t slot = (c / 16) * 32 + (c % 16) * 2;  // + k % 2
        const uint16_t* row = src + (p * kPanel + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K2 + k / 2) * kPairSlots + slot + k % 2] = row[k];
      }
  });
  return packed;
}

// x: [M, K] bf16, packed: pack_bf16_weight of a [N, K] weight -> [M, N] bf16. dot: VDPBF16PS
// (the caller checks the CPU has it; never in the AVX2 build), else widen + FMA.
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, bool dot) {
  TORCH_CHECK(x_in.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPairSlots
                  && packed.size(1) == (x_in.size(1) + 1) / 2 && packed.size(0) == (N + kPanel - 1) / kPanel,
              "bf16_linear: x [M, K] and panels [ceil(N/32), ceil(K/2), 64] expected, got ", x_in.sizes(), " and ",
              packed.sizes(), " for N=", N);
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear: bf16 tensors expected");
  TORCH_CHECK(packed.is_contiguous(), "bf16_linear: the panels must be contiguous");
#if defined(SPECMESH_ISA_AVX2)
  TORCH_CHECK(!dot, "bf16_linear: dot=True needs AVX512-BF16; this is the AVX2 build of the module");
#endif
  const int64_t M = x_in.size(0), K = x_in.size(1), P = packed.size(0), K2 = packed.size(1);
  at::Tensor out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  // [M, 2*K2], contiguous, a zero column where K is odd: bf16 for VDPBF16PS, float32 (exact) for FMA.
  at::Tensor x = dot ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  if (2 * K2 != K) x = at::constant_pad_nd(x, {0, 1});
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const char* xp = static_cast<const char*>(x.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#if defined(SPECMESH_ISA_AVX2)
  run_fma(reinterpret_cast<const float*>(xp), M, K2, wp, P, N, yp);
#else
  if (dot) run<true>(xp, x.element_size(), M, K2, wp, P, N, yp);
  else run<false>(xp, x.element_size(), M, K2, wp, P, N, yp);
#endif
  return out;
}
