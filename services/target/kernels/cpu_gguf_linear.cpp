// Linear layers over GGUF block-quantized weights (Q8_0, Q5_0, Q4_K, Q6_K), bit-identical to
// dequantizing them to bf16 and multiplying with bf16_linear's VDPBF16PS loop (cpu_linear.cpp).
//
// Every one of these block types dequantizes to w = S * q - D in float32 (gguf.quants; llama.cpp's
// ggml-quants.c dequantize_row_*): q a small integer, S a scale and D an offset per sub-block of
// 16 or 32 k (D = 0 for the symmetric types, and x - 0 = x bit for bit, -0 included). Today's
// conversion rounds that float32 once to bf16 (round to nearest even). The kernel computes the same
// two float32 operations in registers, rounds with VCVTNE2PS2BF16 (also round to nearest even; it
// flushes subnormals, which products of an fp16 scale and a small integer never are), and feeds the
// bf16 pairs to VDPBF16PS exactly as bf16_linear does: one float32 sum per output column, over the
// k pairs in order, the even k in a pair's low half. So every output equals bf16_linear's.
//
// Layout (cpu_gguf_linear.py repacks the file's blocks once at load; the values are the file's):
//   quants [G = ceil(N / 16), K / 2, 32] int8: group g holds columns 16g .. 16g + 15; at [g, kk]
//     column c's (k = 2kk, 2kk + 1) pair sits at 2c, 2c + 1, so the first 16 bytes widen to the
//     float32 lanes of columns 0-7 and the next 16 to those of columns 8-15, already in the
//     order VCVTNE2PS2BF16 then VDPBF16PS want.
//   or, where every q is in [0, 15] (Q4_K), quants [G, K / 2, 16] uint8 nibbles: byte i holds the
//     int8 layout's byte i (low nibble) and byte 16 + i (high nibble), half the bytes. (Q5_0's and
//     Q6_K's 5 and 6 bits as nibbles plus bit planes measured slower than a byte a weight: their
//     expansion, not memory, then bounds a decode row.)
//   scales [G, K / SB, 16] float32, and offsets (same shape, or empty): S and D per column and
//     sub-block of SB k.
// Decode rows (M <= 3) expand each group's weights in registers for every row at once; more rows
// expand a 32-column panel to bf16 in a small buffer first and run the row tiles over it. Where the
// caller asks for AMX (bf16_linear would take its AMX tiles for these rows: cpu_linear.py), the
// expanded panel goes to the same AMX loop (cpu_amx.h), so outputs stay equal to bf16_linear's.
//
// The AVX2 build (cpu_gguf_linear_avx2.h) reads the same layout and matches that build's
// bf16_linear instead: each weight widened to float32 and summed in k order with FMA.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_amx.h"
#include "cpu_kernels.h"
#include "cpu_panels.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// The layout both builds read.
constexpr int64_t kGroup = 16;  // output columns per group: one AVX-512 float32 vector of sums (two AVX2 ones)

struct Weights {
  const int8_t* quants;  // int8 [G, K2, 32], or (NIB) uint8 nibbles [G, K2, 16]
  const float* scales;
  const float* offsets;  // nullptr: symmetric (D = 0)
  int64_t K2, sub_pairs, subs;  // k pairs, k pairs per sub-block, sub-blocks per column
};

}  // namespace

#if defined(SPECMESH_ISA_AVX512)

namespace {

// Sub-block sb of group g: its S (and D) per column, each doubled into the lanes of a column's pair:
// lo for columns 0-7, hi for 8-15.
struct SubScales {
  __m512 s_lo, s_hi, d_lo, d_hi;
};

inline SubScales sub_scales(const Weights& w, int64_t g, int64_t sb) {
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  const int64_t at = (g * w.subs + sb) * kGroup;
  const __m512 s = _mm512_loadu_ps(w.scales + at);
  SubScales out{_mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(hi, s), _mm512_setzero_ps(), _mm512_setzero_ps()};
  if (w.offsets != nullptr) {
    const __m512 d = _mm512_loadu_ps(w.offsets + at);
    out.d_lo = _mm512_permutexvar_ps(lo, d);
    out.d_hi = _mm512_permutexvar_ps(hi, d);
  }
  return out;
}

// The 16 columns' bf16 (2kk, 2kk + 1) pairs of group g: round_bf16(S * q - D), as bf16_linear's panel holds them.
template <bool OFFSETS, bool NIB>
SPECMESH_DOT_TARGET inline __m512bh expand(const Weights& w, int64_t g, int64_t kk, const SubScales& s) {
  __m512 lo, hi;
  if (NIB) {  // the same q from one 16-byte load: low nibbles columns 0-7, high nibbles 8-15
    const int8_t* q = w.quants + (g * w.K2 + kk) * kGroup;
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(0x0F))), s.s_lo);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), s.s_hi);
  } else {
    const int8_t* q = w.quants + (g * w.K2 + kk) * 2 * kGroup;
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), s.s_lo);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), s.s_hi);
  }
  if (OFFSETS) {
    lo = _mm512_sub_ps(lo, s.d_lo);
    hi = _mm512_sub_ps(hi, s.d_hi);
  }
  return _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo (columns 0-7), 16-31 from hi
}

// Decode rows expand in registers, which keeps a core busy: the hardware prefetchers alone left the
// layers' weights at ~17 GB/s from memory on the AVX512-BF16 EPYC. Each group's next unit (4 groups on,
// the same k) is asked for one cache line at a time while this one expands: a one-row decode step
// 12.6-12.9 -> 12.2-12.5 ms, two rows 13.4 -> 12.8 (alternating in one process; 2 or 8 groups ahead
// measured no better). A prefetch past the weights' end is harmless.
constexpr int64_t kPrefetchGroups = 4;

// Decode rows: MB rows of x ([MB, 2*K2] bf16, row stride ldx) against groups g0 .. g0 + NG, the
// weights expanded in registers once per k pair for all rows. Sums -> out[p * lgroup + m * 16].
template <int NG, int MB, bool OFFSETS, bool NIB>
SPECMESH_DOT_TARGET void register_tile(const uint16_t* x, int64_t ldx, const Weights& w, int64_t g0, float* out,
                                       int64_t lgroup) {
  constexpr int64_t kPairBytes = NIB ? 16 : 32;
  __m512 acc[NG][MB];
  for (int p = 0; p < NG; ++p)
    for (int m = 0; m < MB; ++m) acc[p][m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < w.subs; ++sb) {
    SubScales s[NG];
    for (int p = 0; p < NG; ++p) s[p] = sub_scales(w, g0 + p, sb);
    for (int64_t kk = sb * w.sub_pairs; kk < (sb + 1) * w.sub_pairs; ++kk) {
      if (((kk * kPairBytes) & 63) == 0)  // a new cache line of each group's quants
        for (int p = 0; p < NG; ++p)
          _mm_prefetch(reinterpret_cast<const char*>(w.quants) + ((g0 + p + kPrefetchGroups) * w.K2 + kk) * kPairBytes,
                       _MM_HINT_T0);
      __m512bh wv[NG];
      for (int p = 0; p < NG; ++p) wv[p] = expand<OFFSETS, NIB>(w, g0 + p, kk, s[p]);
      for (int m = 0; m < MB; ++m) {
        int32_t pair;  // x[m, 2kk], x[m, 2kk + 1]
        std::memcpy(&pair, x + m * ldx + 2 * kk, sizeof(pair));
        const __m512bh xpair = (__m512bh)_mm512_set1_epi32(pair);
        for (int p = 0; p < NG; ++p) acc[p][m] = _mm512_dpbf16_ps(acc[p][m], wv[p], xpair);
      }
    }
  }
  for (int p = 0; p < NG; ++p)
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + p * lgroup + m * kGroup, acc[p][m]);
}

// Groups g0, g0 + 1 expanded to bf16 pairs: panel[kk * 2 + h] = group g0 + h's pairs at kk.
template <bool OFFSETS, bool NIB>
SPECMESH_DOT_TARGET void expand_panel(const Weights& w, int64_t g0, int64_t groups, __m512bh* panel) {
  for (int64_t h = 0; h < groups; ++h)
    for (int64_t sb = 0; sb < w.subs; ++sb) {
      const SubScales s = sub_scales(w, g0 + h, sb);
      for (int64_t kk = sb * w.sub_pairs; kk < (sb + 1) * w.sub_pairs; ++kk) panel[kk * 2 + h] = expand<OFFSETS, NIB>(w, g0 + h, kk, s);
    }
}

// MB rows against an expanded panel of H groups (bf16_linear's dot_tile over a panel in cache).
template <int H, int MB>
SPECMESH_DOT_TARGET void panel_tile(const uint16_t* x, int64_t ldx, const __m512bh* panel, int64_t K2, float* out,
                                    int64_t lgroup) {
  __m512 acc[H][MB];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MB; ++m) acc[h][m] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512bh wv[H];
    for (int h = 0; h < H; ++h) wv[h] = panel[kk * 2 + h];
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kk, sizeof(pair));
      const __m512bh xpair = (__m512bh)_mm512_set1_epi32(pair);
      for (int h = 0; h < H; ++h) acc[h][m] = _mm512_dpbf16_ps(acc[h][m], wv[h], xpair);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + h * lgroup + m * kGroup, acc[h][m]);
}

using PanelTile = void (*)(const uint16_t*, int64_t, const __m512bh*, int64_t, float*, int64_t);

template <int H>
void panel_rows(const uint16_t* x, int64_t ldx, int64_t M, const __m512bh* panel, int64_t K2, float* buf,
                int64_t lgroup) {
  constexpr int kMaxRows = 12;
  constexpr PanelTile tiles[kMaxRows + 1] = {
      nullptr, &panel_tile<H, 1>, &panel_tile<H, 2>, &panel_tile<H, 3>, &panel_tile<H, 4>, &panel_tile<H, 5>,
      &panel_tile<H, 6>, &panel_tile<H, 7>, &panel_tile<H, 8>, &panel_tile<H, 9>, &panel_tile<H, 10>,
      &panel_tile<H, 11>, &panel_tile<H, 12>};
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, M - m);
    tiles[rows](x + m * ldx, ldx, panel, K2, buf + m * kGroup, lgroup);
  }
}

// buf's rows [0, rows) of group g (16 float32 each) -> y[m, 16g ...] bf16 (row stride ldy), up to N.
inline void write_group(const float* buf, int64_t rows, int64_t g, int64_t N, uint16_t* y, int64_t ldy) {
  const __mmask16 mask = specmesh_simd::lanes(N - g * kGroup);
  for (int64_t m = 0; m < rows; ++m)
    specmesh_simd::store_bf16(y + m * ldy + g * kGroup, specmesh_simd::round_bf16(_mm512_loadu_ps(buf + m * kGroup)), mask);
}

// AMX: x [M_pad, 2*K2] (rows padded to whole tiles); each pair of groups expanded to a bf16 panel,
// then the AMX loop over it, as bf16_linear's AMX path over the packed panel.
template <bool OFFSETS, bool NIB>
void run_amx(const uint16_t* x, int64_t M_pad, int64_t M, const Weights& w, int64_t G, int64_t N, uint16_t* y) {
  const int64_t m_chunk = specmesh_amx::kRowChunk;
  at::parallel_for(0, (G + 1) / 2, 2, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> panel(w.K2 * 2);  // [K2, 64] bf16: bf16_linear's panel of these 32 columns
    std::vector<float> block(std::min(m_chunk, M_pad) * 2 * kGroup);
    specmesh_amx::begin();
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g0 = u * 2, groups = std::min<int64_t>(2, G - g0);
      if (groups == 1) std::fill(panel.begin(), panel.end(), (__m512bh)_mm512_setzero_si512());
      expand_panel<OFFSETS, NIB>(w, g0, groups, panel.data());
      for (int64_t m0 = 0; m0 < M_pad; m0 += m_chunk) {
        const int64_t rows_pad = std::min(m_chunk, M_pad - m0), rows = std::min(rows_pad, M - m0);
        specmesh_amx::panel_rows(x + m0 * 2 * w.K2, 2 * w.K2, rows_pad, reinterpret_cast<const uint16_t*>(panel.data()),
                                 w.K2, block.data());
        specmesh_panels::write_panel(block.data(), rows, u, N, y + m0 * N);
      }
    }
    specmesh_amx::end();
  });
}

template <bool OFFSETS, bool NIB>
void run(const uint16_t* x, int64_t M, const Weights& w, int64_t G, int64_t N, uint16_t* y) {
  const int64_t ldx = 2 * w.K2;
  if (M <= 3) {  // decode: 4 groups (64 columns) per pass keep loads and sum chains in flight
    constexpr int64_t kNG = 4;
    at::parallel_for(0, (G + kNG - 1) / kNG, 8, [&](int64_t begin, int64_t end) {
      float buf[kNG * 3 * kGroup];
      const int64_t lgroup = M * kGroup;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t g0 = u * kNG, groups = std::min(kNG, G - g0);
        for (int64_t p = 0; p < groups;) {
          if (groups - p == kNG) {
            if (M == 1) register_tile<4, 1, OFFSETS, NIB>(x, ldx, w, g0, buf, lgroup);
            else if (M == 2) register_tile<4, 2, OFFSETS, NIB>(x, ldx, w, g0, buf, lgroup);
            else register_tile<4, 3, OFFSETS, NIB>(x, ldx, w, g0, buf, lgroup);
            p = kNG;
          } else {
            float* b = buf + p * lgroup;
            if (M == 1) register_tile<1, 1, OFFSETS, NIB>(x, ldx, w, g0 + p, b, lgroup);
            else if (M == 2) register_tile<1, 2, OFFSETS, NIB>(x, ldx, w, g0 + p, b, lgroup);
            else register_tile<1, 3, OFFSETS, NIB>(x, ldx, w, g0 + p, b, lgroup);
            ++p;
          }
        }
        for (int64_t p = 0; p < groups; ++p) write_group(buf + p * lgroup, M, g0 + p, N, y, N);
      }
    });
    return;
  }
  // More rows: expand two groups (32 columns) to bf16 once, then every row tile reads them from cache.
  const int64_t m_chunk = 96;  // rows per pass over a panel (their x stays in L2)
  at::parallel_for(0, (G + 1) / 2, 2, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> panel(w.K2 * 2);
    std::vector<float> block(2 * std::min(m_chunk, M) * kGroup);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g0 = u * 2, groups = std::min<int64_t>(2, G - g0);
      expand_panel<OFFSETS, NIB>(w, g0, groups, panel.data());
      for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
        const int64_t rows = std::min(m_chunk, M - m0), lgroup = rows * kGroup;
        if (groups == 2) panel_rows<2>(x + m0 * ldx, ldx, rows, panel.data(), w.K2, block.data(), lgroup);
        else panel_rows<1>(x + m0 * ldx, ldx, rows, panel.data(), w.K2, block.data(), lgroup);
        for (int64_t h = 0; h < groups; ++h) write_group(block.data() + h * lgroup, rows, g0 + h, N, y + m0 * N, N);
      }
    }
  });
}

// Row n of the weight (column n of the layout) as bf16 [K]: `expand`'s own values, pair by pair (a group
// expanded, column n's 32-bit lane kept: its k = 2kk in the low word, 2kk + 1 in the high).
template <bool OFFSETS, bool NIB>
SPECMESH_DOT_TARGET void expand_row(const Weights& w, int64_t n, uint16_t* out) {
  const int64_t g = n / kGroup, c = n % kGroup;
  alignas(64) uint32_t pairs[kGroup];
  for (int64_t sb = 0; sb < w.subs; ++sb) {
    const SubScales s = sub_scales(w, g, sb);
    for (int64_t kk = sb * w.sub_pairs; kk < (sb + 1) * w.sub_pairs; ++kk) {
      _mm512_store_si512(pairs, (__m512i)expand<OFFSETS, NIB>(w, g, kk, s));
      std::memcpy(out + 2 * kk, pairs + c, sizeof(uint32_t));
    }
  }
}

}  // namespace

#endif  // SPECMESH_ISA_AVX512

#if defined(SPECMESH_ISA_AVX2)
namespace {
using specmesh_panels::kPairSlots;
using specmesh_panels::kPanel;
}  // namespace
#include "cpu_linear_avx2.h"       // widened_tile: bf16_linear's AVX2 row tiles over a widened panel
#include "cpu_gguf_linear_avx2.h"  // run, expand_row: the AVX2 loops over the blocks
#endif

// x: [M, K] bf16; quants [ceil(N/16), K/2, 32] int8 (or [.., 16] uint8 nibbles); scales [ceil(N/16), K/SB, 16]
// f32; offsets the same or empty -> [M, N] bf16, equal to bf16_linear(x, pack(round_bf16(S * q - D)), N,
// dot=True), or with amx (the caller checks amx_ready() and K % 32 == 0) to bf16_linear_amx of the same.
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& quants, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t N, bool amx) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "gguf_linear: x must be bf16 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), G = (N + 15) / 16;
  const bool nib = quants.dim() == 3 && quants.scalar_type() == at::kByte && quants.size(2) == 16;
  TORCH_CHECK(quants.dim() == 3 && (nib || (quants.scalar_type() == at::kChar && quants.size(2) == 32))
                  && quants.size(0) == G && quants.size(1) * 2 == K && quants.is_contiguous(),
              "gguf_linear: quants [ceil(N/16), K/2, 32] int8 or [ceil(N/16), K/2, 16] uint8 nibbles expected, got ",
              quants.sizes(), " for N=", N, ", K=", K);
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.size(0) == G && scales.size(2) == 16
                  && scales.size(1) > 0 && K % scales.size(1) == 0 && (K / scales.size(1)) % 2 == 0
                  && scales.is_contiguous(),
              "gguf_linear: scales [ceil(N/16), K/SB, 16] float32 expected (SB even), got ", scales.sizes());
  const bool has_offsets = offsets.numel() > 0;
  TORCH_CHECK(!has_offsets || (offsets.sizes() == scales.sizes() && offsets.scalar_type() == at::kFloat
                               && offsets.is_contiguous()),
              "gguf_linear: offsets must match scales or be empty");
  at::Tensor out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  const int64_t subs = scales.size(1);
  const Weights w{static_cast<const int8_t*>(quants.data_ptr()), scales.data_ptr<float>(),
                  has_offsets ? offsets.data_ptr<float>() : nullptr, K / 2, K / subs / 2, subs};
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#if defined(SPECMESH_ISA_AVX2)
  TORCH_CHECK(!amx, "gguf_linear: amx needs the AVX-512 build of the module");
  const at::Tensor xf = x_in.to(at::kFloat).contiguous();  // [M, K] float32: bf16 widened (exact), as bf16_linear's FMA loop takes it
  const float* xp = xf.data_ptr<float>();
  if (has_offsets) nib ? run<true, true>(xp, M, w, G, N, yp) : run<true, false>(xp, M, w, G, N, yp);
  else nib ? run<false, true>(xp, M, w, G, N, yp) : run<false, false>(xp, M, w, G, N, yp);
#else
  at::Tensor x = x_in.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (amx) {
    TORCH_CHECK(K % specmesh_amx::kTileK == 0 && amx_ready(), "gguf_linear: amx needs K % 32 == 0 and the AMX tiles");
    const int64_t M_pad = (M + specmesh_amx::kTileRows - 1) / specmesh_amx::kTileRows * specmesh_amx::kTileRows;
    if (M_pad != M) x = at::constant_pad_nd(x, {0, 0, 0, M_pad - M});
    const uint16_t* xpad = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    if (has_offsets)
      nib ? run_amx<true, true>(xpad, M_pad, M, w, G, N, yp) : run_amx<true, false>(xpad, M_pad, M, w, G, N, yp);
    else
      nib ? run_amx<false, true>(xpad, M_pad, M, w, G, N, yp) : run_amx<false, false>(xpad, M_pad, M, w, G, N, yp);
  } else if (has_offsets) {
    nib ? run<true, true>(xp, M, w, G, N, yp) : run<true, false>(xp, M, w, G, N, yp);
  } else {
    nib ? run<false, true>(xp, M, w, G, N, yp) : run<false, false>(xp, M, w, G, N, yp);
  }
#endif
  return out;
}

// Rows `ids` [T] of the weight [N, K] the layout holds, as bf16 [T, K]: the tied embedding's lookup,
// and the argmax screen's exact tokens, in the values gguf_linear multiplies.
at::Tensor gguf_rows(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& offsets,
                     const at::Tensor& ids_in, int64_t N) {
  TORCH_CHECK(quants.dim() == 3 && quants.is_contiguous() && scales.dim() == 3 && scales.is_contiguous()
                  && scales.scalar_type() == at::kFloat && scales.size(0) == quants.size(0)
                  && scales.size(2) == 16 && (N + 15) / 16 == quants.size(0),
              "gguf_rows: the layout gguf_linear takes is expected");
  const bool nib = quants.scalar_type() == at::kByte && quants.size(2) == 16;
  TORCH_CHECK(nib || (quants.scalar_type() == at::kChar && quants.size(2) == 32), "gguf_rows: int8 or nibble quants");
  const bool has_offsets = offsets.numel() > 0;
  TORCH_CHECK(!has_offsets || (offsets.sizes() == scales.sizes() && offsets.scalar_type() == at::kFloat
                               && offsets.is_contiguous()), "gguf_rows: offsets must match scales or be empty");
  const int64_t K = quants.size(1) * 2, subs = scales.size(1);
  TORCH_CHECK(K % subs == 0 && (K / subs) % 2 == 0, "gguf_rows: K must be whole, even sub-blocks");
  at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < N, "gguf_rows: id ", id[t], " outside [0, ", N, ")");
  at::Tensor out = at::empty({T, K}, scales.options().dtype(at::kBFloat16));
  const Weights w{static_cast<const int8_t*>(quants.data_ptr()), scales.data_ptr<float>(),
                  has_offsets ? offsets.data_ptr<float>() : nullptr, K / 2, K / subs / 2, subs};
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto row = has_offsets ? (nib ? &expand_row<true, true> : &expand_row<true, false>)
                               : (nib ? &expand_row<false, true> : &expand_row<false, false>);
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) row(w, id[t], y + t * K);
  });
  return out;
}
