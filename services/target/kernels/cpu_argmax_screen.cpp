// The argmax screen of the output layer (argmax_screen.py): for rows whose only reader is a greedy
// argmax, a cheap int8 pass over the whole vocabulary that bounds every logit from above and
// below, so that only the few tokens that can still be the argmax are computed exactly.
//
// The weights are kept as int8 per block of B k (64 where the hidden size allows, else 32) with one fp16
// scale per column and block (q = round(w / s), stored as q + 128 in uint8), the rows' x as int8 per
// block of B with one float32 scale per row and block (p = round(x / t)). VPDPBUSD multiplies 64 uint8 x int8 pairs a
// step: (q + 128) * p summed over a block, less the row's 128 * sum(p) over that block, is
// sum(q * p) exactly in int32; times s * t, summed over the blocks in float32, it is the
// approximate logit a. Its distance to the exact one is at most
//   E = alpha * |w - w_hat| + beta * |w_hat|   (Euclidean norms of the column's weight error and of
// its quantized weight, both taken once at load; alpha and beta per row from its x and x_hat:
// argmax_screen.py derives them, with the float32 roundings of both paths). The kernel writes
// a + E (the upper bound) per column and the largest a - E (the best lower bound) per row.
//
// Layout: quants [G = ceil(N / 16), K / 4, 16, 4] uint8 (a column's 4 consecutive k in one int32
// lane, 16 columns a vector: VPDPBUSD's weight operand as it lies); scales [G, K / B, 16] fp16.
//
// On a CPU with AMX-INT8, `amx` runs the int8 pass on tiles: one TDPBSUD multiplies 16 rows x B k of
// p (signed) by a block's B / 4 x 64 bytes of one group's quants (unsigned; AMX's weight tile layout
// as they lie) into 16 x 16 int32 sums. The float32 epilogue per row, column and block is the
// VPDPBUSD loop's, op for op and in the same order, so both paths return the same bits
// (tests/target/test_argmax_screen.py). That epilogue, not the multiplies, is most of the pass's
// work from a few rows on (a load, a subtraction, a conversion, a multiply and an FMA per 16
// columns, row and block), with the tile store and reload per block: hence B = 64 (half the blocks
// of B = 32, for the loop too) and the row totals kept in registers.
//
// The AVX2 build (cpu_argmax_screen_avx2.h) has no VPDPBUSD: it multiplies |p| (unsigned) by q with
// p's sign (VPSIGNB; q from the stored q + 128 by flipping its top bit) with VPMADDUBSW, whose int16
// pair sums cannot saturate (2 * 127 * 127 < 2^15), and VPMADDWD against ones gives each column's
// sum of 4 products in int32: the same exact integers as sum((q + 128) p) - 128 sum(p), then the same
// float32 epilogue, op for op, 8 columns a vector. The bound is the same: it holds for any exact
// integer sums followed by that epilogue.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kCols = 16;  // columns per group: one AVX-512 vector of int32 sums, two AVX2 ones

struct Screen {
  const uint8_t* quants;
  const uint16_t* scales;  // fp16 bits
  const float* weight_err;  // |w - w_hat| per column
  const float* weight_norm;  // |w_hat| per column
  int64_t K4, blocks, quads, N;  // quads: k / 4 per block (VPDPBUSD steps, tile rows of B)
};

struct Rows {
  const int8_t* p;  // [M, K]
  const float* t;  // [M, blocks]
  const int32_t* corr;  // [M, blocks]: 128 * sum of p over the block
  const float* alpha;  // [M]
  const float* beta;  // [M]
  int64_t K;
};

// Per group and row: the best lower bound and the largest upper bound ([G, M] each).
struct Extremes {
  float* lower;
  float* upper;
  int64_t M;
};

}  // namespace

#if defined(SPECMESH_ISA_AVX2)
#include "cpu_argmax_screen_avx2.h"  // loop_groups: the int8 pass, 8 columns a vector
#else  // SPECMESH_ISA_AVX512

namespace {

#define SPECMESH_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))

// One group's approximate logits `total` of one row -> its upper bounds (into upper) and the
// group's largest upper and lower bound for the row (into ext). Both passes end here.
inline void write_bounds(const Screen& s, const Rows& r, int64_t g, int64_t row, __m512 total, float* upper,
                         const Extremes& ext) {
  const __m512 inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __mmask16 mask = specmesh_simd::lanes(s.N - g * kCols);
  const __m512 err = _mm512_maskz_loadu_ps(mask, s.weight_err + g * kCols);
  const __m512 norm = _mm512_maskz_loadu_ps(mask, s.weight_norm + g * kCols);
  const __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(r.alpha[row]), err,
                                       _mm512_mul_ps(_mm512_set1_ps(r.beta[row]), norm));
  const __m512 up = _mm512_add_ps(total, bound);
  _mm512_mask_storeu_ps(upper + row * s.N + g * kCols, mask, up);
  ext.upper[g * ext.M + row] = _mm512_reduce_max_ps(_mm512_mask_blend_ps(mask, inf, up));
  const __m512 low = _mm512_sub_ps(total, bound);
  ext.lower[g * ext.M + row] = _mm512_reduce_max_ps(_mm512_mask_blend_ps(mask, inf, low));
}

// Rows m0 .. m0 + MB against groups g0 .. g0 + NG (NG x MB independent sum chains): upper bounds ->
// upper[m, 16g ...], each group's extremes per row -> ext.
template <int NG, int MB>
SPECMESH_VNNI_TARGET void group_rows(const Screen& s, const Rows& r, int64_t m0, int64_t g0, float* upper,
                                     const Extremes& ext) {
  __m512 total[NG][MB];
  for (int h = 0; h < NG; ++h)
    for (int m = 0; m < MB; ++m) total[h][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < s.blocks; ++b) {
    __m512i acc[NG][MB];
    for (int h = 0; h < NG; ++h)
      for (int m = 0; m < MB; ++m) acc[h][m] = _mm512_setzero_si512();
    for (int64_t j = 0; j < s.quads; ++j) {
      __m512i w[NG];
      for (int h = 0; h < NG; ++h) w[h] = _mm512_loadu_si512(s.quants + ((g0 + h) * s.K4 + b * s.quads + j) * 64);
      for (int m = 0; m < MB; ++m) {
        int32_t quad;  // p[m, 4(quads b + j) .. + 3]
        std::memcpy(&quad, r.p + (m0 + m) * r.K + (b * s.quads + j) * 4, sizeof(quad));
        const __m512i xq = _mm512_set1_epi32(quad);
        for (int h = 0; h < NG; ++h) acc[h][m] = _mm512_dpbusd_epi32(acc[h][m], w[h], xq);
      }
    }
    for (int h = 0; h < NG; ++h) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          s.scales + ((g0 + h) * s.blocks + b) * kCols)));
      for (int m = 0; m < MB; ++m) {
        const int64_t at = (m0 + m) * s.blocks + b;
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[h][m], _mm512_set1_epi32(r.corr[at])));
        total[h][m] = _mm512_fmadd_ps(sums, _mm512_mul_ps(scale, _mm512_set1_ps(r.t[at])), total[h][m]);
      }
    }
  }
  for (int h = 0; h < NG; ++h)
    for (int m = 0; m < MB; ++m) write_bounds(s, r, g0 + h, m0 + m, total[h][m], upper, ext);
}

template <int NG>
void groups_rows(const Screen& s, const Rows& r, int64_t M, int64_t g0, float* upper, const Extremes& ext) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {  // 4 rows share each weight load
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: group_rows<NG, 1>(s, r, m0, g0, upper, ext); break;
      case 2: group_rows<NG, 2>(s, r, m0, g0, upper, ext); break;
      case 3: group_rows<NG, 3>(s, r, m0, g0, upper, ext); break;
      default: group_rows<NG, 4>(s, r, m0, g0, upper, ext); break;
    }
  }
}

#define SPECMESH_AMX_INT8_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,amx-tile,amx-int8")))

constexpr int64_t kTileRows = 16;

// The tile palette of the AMX pass for blocks of Q quads: tmm0-1 int32 sums of a 16-row tile against
// one group (alternate blocks, so one block's sums are read while the next multiplies), tmm2-3 the
// rows' p of those blocks (16 rows x 4Q bytes), tmm4-5 the group's quants (Q rows of 64 bytes).
template <int Q>
struct alignas(64) ScreenTiles {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 4 * Q, 4 * Q, 64, 64};
  uint8_t rows[16] = {kTileRows, kTileRows, kTileRows, kTileRows, Q, Q};
};
// Constants in memory: GCC drops stores to a local config as dead (cpu_amx_linear.cpp says why).
constexpr ScreenTiles<8> kTiles32{};
constexpr ScreenTiles<16> kTiles64{};

// One block's int32 sums of a 16-row tile on tiles (C, A, B) into sums [16, 16]. (GCC's tile
// intrinsics take the register numbers as literals, hence a macro.)
#define SPECMESH_SCREEN_TILE_BLOCK(C, A, B)                                  \
  do {                                                                       \
    _tile_zero(C);                                                           \
    _tile_loadd(A, p_tile + b * 4 * s.quads, r.K);                           \
    _tile_loadd(B, s.quants + (g * s.K4 + b * s.quads) * 64, 64);            \
    _tile_dpbsud(C, A, B);                                                   \
    _tile_stored(C, &sums[C][0][0], kCols * 4);                              \
  } while (0)

// As group_rows for one group and R rows from m0 (p, t and corr padded to whole tiles from m0), the
// R row totals in registers. The float32 arithmetic per row and column is group_rows', in its order.
template <int R>
SPECMESH_AMX_INT8_TARGET void tile_rows(const Screen& s, const Rows& r, const int8_t* p_pad, int64_t m0, int64_t M,
                                        int64_t g, float* upper, const Extremes& ext) {
  alignas(64) int32_t sums[2][kTileRows][kCols];
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  const int8_t* p_tile = p_pad + m0 * r.K;
  for (int64_t b = 0; b < s.blocks; ++b) {
    if (b % 2 == 0) SPECMESH_SCREEN_TILE_BLOCK(0, 2, 4);
    else SPECMESH_SCREEN_TILE_BLOCK(1, 3, 5);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        s.scales + (g * s.blocks + b) * kCols)));
    for (int m = 0; m < R; ++m) {
      const int64_t at = (m0 + m) * s.blocks + b;
      const __m512 got = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(sums[b % 2][m]),
                                                             _mm512_set1_epi32(r.corr[at])));
      total[m] = _mm512_fmadd_ps(got, _mm512_mul_ps(scale, _mm512_set1_ps(r.t[at])), total[m]);
    }
  }
  for (int m = 0; m < R && m0 + m < M; ++m) write_bounds(s, r, g, m0 + m, total[m], upper, ext);  // not padding rows
}

// Groups [begin, end) for every row, on tiles (one thread's share). Rows go in tiles of 16 and a
// last one of 1, 2, 4 or 8 (rounded up: the padding rows' sums are computed and dropped).
SPECMESH_AMX_INT8_TARGET void tile_groups(const Screen& s, const Rows& r, const int8_t* p_pad, int64_t M,
                                          int64_t begin, int64_t end, float* upper, const Extremes& ext) {
  _tile_loadconfig(s.quads == 16 ? static_cast<const void*>(&kTiles64) : static_cast<const void*>(&kTiles32));
  for (int64_t g = begin; g < end; ++g)
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {  // the group's quants stay in L1 across row tiles
      const int64_t rows = M - m0;
      if (rows > 8) tile_rows<16>(s, r, p_pad, m0, M, g, upper, ext);
      else if (rows > 4) tile_rows<8>(s, r, p_pad, m0, M, g, upper, ext);
      else if (rows > 2) tile_rows<4>(s, r, p_pad, m0, M, g, upper, ext);
      else if (rows > 1) tile_rows<2>(s, r, p_pad, m0, M, g, upper, ext);
      else tile_rows<1>(s, r, p_pad, m0, M, g, upper, ext);
    }
  _tile_release();
}

// The int8 pass without tiles, every row and group (the VPDPBUSD loop).
void loop_groups(const Screen& s, const Rows& r, int64_t M, int64_t G, float* up, const Extremes& ext) {
  // Groups a pass: more independent sum chains where few rows give each weight load little work
  // (one row: 8 groups against 2, 4.4 -> 3.9 ms over the default model's layer on the
  // AVX512-BF16 EPYC; two rows: 4); from 3 rows, 2 (more would spill the sums' registers).
  const int64_t width = M == 1 ? 8 : M == 2 ? 4 : 2;
  at::parallel_for(0, (G + width - 1) / width, 64 / width, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g0 = u * width, groups = std::min(width, G - g0);
      // The wide tiles only for the row count they are built for: a one-row pass's last unit of 4
      // groups (G % 8 == 4) taking the two-row tile read and wrote a second row that is not there.
      if (width == 8 && groups == 8) group_rows<8, 1>(s, r, 0, g0, up, ext);
      else if (width == 4 && groups == 4) group_rows<4, 2>(s, r, 0, g0, up, ext);
      else
        for (int64_t g = g0; g < g0 + groups; g += 2) {
          if (g + 1 < g0 + groups) groups_rows<2>(s, r, M, g, up, ext);
          else groups_rows<1>(s, r, M, g, up, ext);
        }
    }
  });
}

}  // namespace

#endif  // SPECMESH_ISA_AVX512

namespace {

// The columns (ascending) where some row's upper bound reaches its threshold: only in the groups
// whose largest upper bound (ext) reaches it for some row, a few of the vocabulary's.
std::vector<int64_t> chosen_columns(const float* upper, const Extremes& ext, const float* threshold, int64_t M,
                                    int64_t N) {
  constexpr int64_t kSpan = 256;  // groups per task
  const int64_t G = (N + kCols - 1) / kCols, spans = (G + kSpan - 1) / kSpan;
  std::vector<std::vector<int64_t>> found(spans);
  at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t g = c * kSpan; g < std::min(G, (c + 1) * kSpan); ++g) {
        bool any = false;
        for (int64_t m = 0; m < M && !any; ++m) any = ext.upper[g * M + m] >= threshold[m];
        if (!any) continue;
        for (int64_t j = g * kCols; j < std::min(N, (g + 1) * kCols); ++j)
          for (int64_t m = 0; m < M; ++m)
            if (upper[m * N + j] >= threshold[m]) {
              found[c].push_back(j);
              break;
            }
      }
  });
  std::vector<int64_t> out;
  for (const auto& f : found) out.insert(out.end(), f.begin(), f.end());
  return out;
}

}  // namespace

// p [M, K] int8, t / corr [M, K / B] (float32 / int32), alpha / beta [M] float32; quants, scales,
// weight_err / weight_norm [N] as above -> (upper [M, N] float32, best lower bound [M] float32, the
// columns [C] int64, ascending, where some row's upper bound reaches its best lower bound less
// tie_margin times the larger of |best lower| and |largest upper|). The block B is K over scales'
// second size (32 or 64; p, t and corr are in blocks of B). amx: on AMX-INT8 tiles (the caller checks
// the CPU has them): the same results.
std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_screen(
    const at::Tensor& p, const at::Tensor& t, const at::Tensor& corr, const at::Tensor& alpha, const at::Tensor& beta,
    const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& weight_err, const at::Tensor& weight_norm,
    int64_t N, double tie_margin, bool amx) {
  TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kChar && p.is_contiguous(),
              "argmax_screen: p must be contiguous int8 [M, K]");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) > 0 && (p.size(1) == 32 * scales.size(1) || p.size(1) == 64 * scales.size(1)),
              "argmax_screen: scales [ceil(N/16), K/B, 16] with blocks of B = 32 or 64 k expected, got ", scales.sizes(),
              " for K=", p.size(1));
  const int64_t M = p.size(0), K = p.size(1), blocks = scales.size(1), G = (N + 15) / 16;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(0) == M && t.size(1) == blocks
                  && corr.scalar_type() == at::kInt && corr.is_contiguous() && corr.sizes() == t.sizes(),
              "argmax_screen: t float32 and corr int32 [M, K / B] expected");
  TORCH_CHECK(alpha.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && alpha.numel() == M
                  && beta.numel() == M && alpha.is_contiguous() && beta.is_contiguous(),
              "argmax_screen: alpha and beta float32 [M] expected");
  TORCH_CHECK(quants.scalar_type() == at::kByte && quants.is_contiguous() && quants.dim() == 4
                  && quants.size(0) == G && quants.size(1) * 4 == K && quants.size(2) == 16 && quants.size(3) == 4,
              "argmax_screen: quants [ceil(N/16), K/4, 16, 4] uint8 expected, got ", quants.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3
                  && scales.size(0) == G && scales.size(1) == blocks && scales.size(2) == 16,
              "argmax_screen: scales [ceil(N/16), K/B, 16] float16 expected");
  TORCH_CHECK(weight_err.scalar_type() == at::kFloat && weight_norm.scalar_type() == at::kFloat
                  && weight_err.numel() == N && weight_norm.numel() == N && weight_err.is_contiguous()
                  && weight_norm.is_contiguous(),
              "argmax_screen: weight_err and weight_norm float32 [N] expected");
  at::Tensor upper = at::empty({M, N}, p.options().dtype(at::kFloat));
  at::Tensor best = at::empty({M}, p.options().dtype(at::kFloat));
  at::Tensor columns = at::empty({0}, p.options().dtype(at::kLong));
  if (M == 0 || N == 0) return {upper, best.fill_(-std::numeric_limits<float>::infinity()), columns};
  const Screen s{quants.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                 weight_err.data_ptr<float>(), weight_norm.data_ptr<float>(), K / 4, blocks, K / blocks / 4, N};
  const Rows r{p.data_ptr<int8_t>(), t.data_ptr<float>(), corr.data_ptr<int32_t>(), alpha.data_ptr<float>(),
               beta.data_ptr<float>(), K};
  std::vector<float> lower(G * M), highest(G * M);  // [G, M]
  const Extremes ext{lower.data(), highest.data(), M};
  float* up = upper.data_ptr<float>();
  if (amx) {
#if defined(SPECMESH_ISA_AVX2)
    TORCH_CHECK(false, "argmax_screen: amx needs AMX-INT8 tiles; this is the AVX2 build of the module");
#else
    TORCH_CHECK(amx_ready(), "argmax_screen: the OS did not grant this process the AMX tile registers");
    // p, t and corr padded with zero rows to whole tiles (a tile reads 16 rows; padding sums are dropped)
    const int64_t M_pad = (M + kTileRows - 1) / kTileRows * kTileRows;
    std::vector<int8_t> p_pad(M_pad * K, 0);
    std::vector<float> t_pad(M_pad * blocks, 0.0f);
    std::vector<int32_t> corr_pad(M_pad * blocks, 0);
    std::memcpy(p_pad.data(), r.p, M * K);
    std::memcpy(t_pad.data(), r.t, M * blocks * sizeof(float));
    std::memcpy(corr_pad.data(), r.corr, M * blocks * sizeof(int32_t));
    const Rows padded{p_pad.data(), t_pad.data(), corr_pad.data(), r.alpha, r.beta, K};
    at::parallel_for(0, G, 64, [&](int64_t begin, int64_t end) {
      tile_groups(s, padded, p_pad.data(), M, begin, end, up, ext);
    });
#endif
  } else {
    loop_groups(s, r, M, G, up, ext);
  }
  float* bp = best.data_ptr<float>();
  std::vector<float> threshold(M);
  for (int64_t m = 0; m < M; ++m) {
    float lo = -std::numeric_limits<float>::infinity(), hi = lo;
    for (int64_t g = 0; g < G; ++g) {
      lo = std::max(lo, lower[g * M + m]);
      hi = std::max(hi, highest[g * M + m]);
    }
    bp[m] = lo;
    // Two values farther apart than tie_margin of the larger magnitude round to different bf16 values.
    threshold[m] = lo - static_cast<float>(tie_margin) * std::max(std::fabs(lo), std::fabs(hi)) - 1e-30f;
  }
  const std::vector<int64_t> chosen = chosen_columns(up, ext, threshold.data(), M, N);
  columns = at::empty({static_cast<int64_t>(chosen.size())}, p.options().dtype(at::kLong));
  std::copy(chosen.begin(), chosen.end(), columns.data_ptr<int64_t>());
  return {upper, best, columns};
}
