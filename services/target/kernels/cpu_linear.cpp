// bf16 linear layers for AVX-512 CPUs without native bf16 dot products (no AVX512-BF16, no AMX).
//
// y[M, N] = x[M, K] @ w[N, K]^T, with x and w in bf16, the products and sums in float32 and y
// rounded once to bf16 (round to nearest even), as torch's own bf16 linear does. Every bf16 x bf16
// product is exact in float32 (8 + 8 significant bits), so each output differs from torch's only
// by where a different summation order lands it: here each output is summed over k = 0 .. K-1 in
// order, whatever M, N or the tiling, so a row's outputs do not depend on the other rows of the
// call (batch-invariant).
//
// Why: on such a CPU oneDNN emulates bf16 and was 1.5-7x slower than this (benchmarks/
// linear_formats.py). Weights are packed once into panels of 32 output columns, [P, K, 32] bf16,
// each k's 32 values ordered (c0, c16, c1, c17, ..., c15, c31): a bf16 is the high half of a
// float32, so one 64-byte load widens into columns 0-15 by a 16-bit shift and columns 16-31 by
// masking the low halves. The inner loop broadcasts one float32 x[m, k] per row and does two FMAs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel: two 16-lane float32 vectors

// acc[NP panels][MB rows][2 halves] over k for panels p0 .. p0 + NP of `packed`, rows of `x`
// ([MB, K] float32, row stride ldx); writes out[m, panel columns] (row stride ldo), up to N.
template <int NP, int MB>
inline void microkernel(const float* x, int64_t ldx, const uint16_t* packed, int64_t K, int64_t p0,
                        int64_t N, float* out, int64_t ldo) {
  __m512 acc[NP][MB][2];
  for (int p = 0; p < NP; ++p)
    for (int m = 0; m < MB; ++m) acc[p][m][0] = acc[p][m][1] = _mm512_setzero_ps();
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* panel = packed + p0 * K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    for (int p = 0; p < NP; ++p) {
      const __m512i v = _mm512_loadu_si512(panel + (p * K + k) * kPanel);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));  // columns 0-15
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));  // columns 16-31
      for (int m = 0; m < MB; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
        acc[p][m][0] = _mm512_fmadd_ps(xb, lo, acc[p][m][0]);
        acc[p][m][1] = _mm512_fmadd_ps(xb, hi, acc[p][m][1]);
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t n0 = (p0 + p) * kPanel;
    const int64_t valid = std::min<int64_t>(kPanel, N - n0);
    const __mmask16 m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const __mmask16 m1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
    for (int m = 0; m < MB; ++m) {
      _mm512_mask_storeu_ps(out + m * ldo + n0, m0, acc[p][m][0]);
      _mm512_mask_storeu_ps(out + m * ldo + n0 + 16, m1, acc[p][m][1]);
    }
  }
}

// Rows [0, M) of x against panels [p0, p0 + NP): microtiles of up to MAX_MB rows.
template <int NP, int MAX_MB>
inline void rows(const float* x, int64_t M, int64_t K, const uint16_t* packed, int64_t p0, int64_t N,
                 float* out) {
  int64_t m = 0;
  for (; m + MAX_MB <= M; m += MAX_MB) microkernel<NP, MAX_MB>(x + m * K, K, packed, K, p0, N, out + m * N, N);
  const int64_t left = M - m;
  const float* xm = x + m * K;
  float* om = out + m * N;
#define SPECMESH_TAIL(R) \
  case R: if constexpr (R < MAX_MB) microkernel<NP, R>(xm, K, packed, K, p0, N, om, N); break;
  switch (left) {
    SPECMESH_TAIL(1) SPECMESH_TAIL(2) SPECMESH_TAIL(3) SPECMESH_TAIL(4) SPECMESH_TAIL(5) SPECMESH_TAIL(6)
    SPECMESH_TAIL(7) SPECMESH_TAIL(8) SPECMESH_TAIL(9) SPECMESH_TAIL(10) SPECMESH_TAIL(11)
    default: break;
  }
#undef SPECMESH_TAIL
}

}  // namespace

// w: [N, K] bf16 -> [ceil(N / 32), K, 32] bf16 panels (zero columns past N).
at::Tensor pack_bf16_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kBFloat16, "pack_bf16_weight: bf16 [N, K] expected");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({P, K, kPanel}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
        const int64_t slot = c < 16 ? 2 * c : 2 * (c - 16) + 1;  // (c0, c16, c1, c17, ...)
        const uint16_t* row = src + (p * kPanel + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + slot] = row[k];
      }
  });
  return packed;
}

// x: [M, K] bf16, packed: pack_bf16_weight of a [N, K] weight -> [M, N] bf16.
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel && x_in.size(1) == packed.size(1)
                  && packed.size(0) == (N + kPanel - 1) / kPanel,
              "bf16_linear: x [M, K] and panels [ceil(N/32), K, 32] expected, got ", x_in.sizes(), " and ",
              packed.sizes(), " for N=", N);
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear: bf16 tensors expected");
  TORCH_CHECK(packed.is_contiguous(), "bf16_linear: the panels must be contiguous");
  const int64_t M = x_in.size(0), K = x_in.size(1), P = packed.size(0);
  at::Tensor out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // [M, K] f32 (exact)
  at::Tensor acc = at::empty({M, N}, x.options());  // [M, N] f32
  const float* xp = x.data_ptr<float>();
  float* accp = acc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());

  // Few rows stream the weights (memory-bound): several panels per pass keep more loads and
  // independent FMA chains in flight. Many rows reuse each widened weight vector across 12 rows.
  const int64_t np = M <= 3 ? 4 : M <= 6 ? 2 : 1;
  const int64_t m_chunk = 96;  // rows per pass over a thread's panels (their x stays in L2)
  at::parallel_for(0, (P + np - 1) / np, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
      const int64_t rows_here = std::min(m_chunk, M - m0);
      const float* xm = xp + m0 * K;
      float* om = accp + m0 * N;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p0 = g * np;
        const int64_t panels = std::min(np, P - p0);
        if (panels == 4) rows<4, 3>(xm, rows_here, K, wp, p0, N, om);
        else if (np == 2 && panels == 2) rows<2, 6>(xm, rows_here, K, wp, p0, N, om);
        else
          for (int64_t p = p0; p < p0 + panels; ++p) rows<1, 12>(xm, rows_here, K, wp, p, N, om);
      }
    }
  });
  out.copy_(acc);  // one rounding to bf16 (nearest even)
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16_weight", &pack_bf16_weight, "bf16 [N, K] -> [ceil(N/32), K, 32] panels for bf16_linear");
  m.def("bf16_linear", &bf16_linear, "y = x w^T for bf16 x [M, K] and packed w (float32 sums in k order, bf16 out)");
}
