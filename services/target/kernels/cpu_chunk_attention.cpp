// Attention of prefill chunks (many query rows, each seeing one contiguous run of its kv range)
// over the paged bf16 KV pool, with VDPBF16PS (AVX512-BF16). torch's path for such a piece is a
// copy of the transposed queries, a bf16 baddbmm, a masked softmax and a bmm, its matmuls far
// below the cores' VDPBF16PS peak (numbers: docs/kernels.md). Here a piece's keys are read in
// place from the pool.
//
// Work unit: 16 query vectors of one kv head (query heads of that kv head, row after row: with
// 4 query heads per kv head, 4 rows x 4 heads), attending over the union of their visible runs.
// - scores: lanes are the 16 query vectors, the queries packed as (d, d+1) pairs; each key's
//   pairs are broadcast from the pool, so S is key-major [keys, 16] and the softmax over keys
//   is plain lane-wise arithmetic (each lane masked to its own run [lo, hi)).
// - values: lanes are 16 columns of d; values are packed once per piece and kv head as
//   (key j, key j+1) pairs [keys / 2, D], and each query vector's (p_j, p_j+1) is broadcast.
//
// On a CPU with AMX (Intel Sapphire Rapids and later) a unit's two products run on tiles instead
// (attend_unit_amx): the packed keys are already AMX's layout for the weight operand (16 d pairs
// x 16 keys a tile, 64 bytes a row), the packed values too (16 key pairs x 16 columns of d, a row
// D pairs apart); the unit's queries are copied to [16, D] rows and its probabilities written as
// [16, keys] bf16 rows, the tiles' other operand. Scores come out vector-major ([16, keys]), so
// the softmax runs row by row. Before, such CPUs left prefill chunks to torch's oneDNN matmuls
// (AMX too), which materialise every score of a chunk and copy the queries, keys and values
// around them (docs/kernels.md).
//
// Precision: that of the bf16 matmul path in paged_attention_cpu.py (Hugging Face's eager bf16
// attention): scores = bf16(scale * q.k) with float32 sums, softmax in float32, bf16
// probabilities, out = bf16(sum p * v) with float32 sums; only the order of the float32 sums
// differs (tests/kernels/test_cpu_chunk_attention.py). A row that sees nothing gets zeros.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_amx.h"
#include "cpu_kernels.h"
#include "cpu_paged_checks.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(SPECMESH_ISA_AVX2)

// The AVX2 build has no VDPBF16PS: prefill chunks stay with torch's matmuls there
// (paged_attention_cpu.chunk_kernel_runs asks cpu_linear.bf16_dot_instruction, false without AVX-512).
void chunk_attention_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, double, at::Tensor&, bool) {
  TORCH_CHECK(false, "chunk_attention_bf16: needs AVX512-BF16 (VDPBF16PS); this is the AVX2 build of the module");
}

#else  // SPECMESH_ISA_AVX512

namespace {

using namespace specmesh_simd;

constexpr int kLanes = 16;  // query vectors per work unit
constexpr int kKeys = 16;   // keys per score tile: 16 accumulators in flight

struct Piece {
  int64_t q_start, q_len, kv_offset, kv_len, row_base;  // row_base: its first row in bounds
};

struct Geometry {
  const uint16_t *q, *kc, *vc, *zero;  // zero: one key row of zeros (tiles past a run's end)
  uint16_t* out;
  const int64_t* tables;
  int64_t max_blocks, H, D, BS, KV, group;
  float scale;

  // The pool row of a piece's entry e (0-based in its kv range) for kv head g.
  const uint16_t* row(const uint16_t* cache, int64_t piece, const Piece& p, int64_t e, int64_t g) const {
    const int64_t x = p.kv_offset + e;
    return cache + ((tables[piece * max_blocks + x / BS] * BS + x % BS) * KV + g) * D;
  }
};

// Keys and values of entries [e0, e1) of a piece for kv head g, read once from the pool. Keys in
// tiles of kKeys entries as (d, d+1) pairs, keys[(e / kKeys * D/2 + d/2) * kKeys + e % kKeys]:
// a tile's pairs at one d are adjacent (one base register for the score tile's broadcasts).
// Values as (entry 2i, entry 2i+1) pairs, values[i * D + d] = v[2i][d] | v[2i+1][d] << 16.
// An entry no row of the piece sees (seen[e] false) is packed as zeros, never read: a unit
// multiplies its pair neighbours by p = 0, and 0 * NaN would be NaN.
void pack_piece(const Geometry& G, int64_t piece, const Piece& p, int64_t g, const char* seen, int64_t e0, int64_t e1,
                uint32_t* keys, uint32_t* values) {  // e0 even
  const int64_t D = G.D, D2 = D / 2;
  for (int64_t e = e0; e < e1; ++e) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(seen[e] ? G.row(G.kc, piece, p, e, g) : G.zero);
    uint32_t* dst = keys + (e / kKeys) * D2 * kKeys + e % kKeys;
    for (int64_t dp = 0; dp < D2; ++dp) dst[dp * kKeys] = k[dp];
  }
  for (int64_t i = e0 / 2; 2 * i < e1; ++i) {
    const uint16_t* a = seen[2 * i] ? G.row(G.vc, piece, p, 2 * i, g) : G.zero;
    const uint16_t* b = 2 * i + 1 < e1 && seen[2 * i + 1] ? G.row(G.vc, piece, p, 2 * i + 1, g) : G.zero;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
      _mm512_storeu_si512(values + i * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Scores of the unit's 16 query vectors (qp [D/2, 16] pairs) against one packed key tile
// (tile [D/2, kKeys] pairs), rounded to bf16, into s[k * 16 + lane].
SPECMESH_DOT_TARGET inline void score_tile(const uint32_t* qp, const uint32_t* tile, int64_t D2, float scale, float* s) {
  __m512 acc[kKeys];
  for (int t = 0; t < kKeys; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D2; ++dp) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + dp * kLanes);
    const uint32_t* k = tile + dp * kKeys;
    for (int t = 0; t < kKeys; ++t)
      acc[t] = _mm512_dpbf16_ps(acc[t], q, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(k[t])));
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int t = 0; t < kKeys; ++t) _mm512_storeu_ps(s + t * kLanes, round_bf16(_mm512_mul_ps(acc[t], sc)));
}

// acc (4 query vectors x 64 columns, float32) += sum over key pairs [i0, i1) of (p_2i, p_2i+1) . values
// (pp [pairs, 16] and vp [pairs, D] from the unit's first pair).
SPECMESH_DOT_TARGET inline void value_tile(const uint32_t* pp, const uint32_t* vp, int64_t i0, int64_t i1, int64_t D,
                                           int lane0, int64_t d0, float* acc_io) {
  __m512 acc[4][4];
  for (int m = 0; m < 4; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_loadu_ps(acc_io + (lane0 + m) * D + d0 + 16 * c);
  for (int64_t i = i0; i < i1; ++i) {
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + i * D + d0 + 16 * c);
    const uint32_t* prow = pp + i * kLanes + lane0;
    for (int m = 0; m < 4; ++m) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(prow[m]));
      for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], v[c], p);
    }
  }
  for (int m = 0; m < 4; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_io + (lane0 + m) * D + d0 + 16 * c, acc[m][c]);
}

constexpr int64_t kPairsPerPass = 16;  // key pairs of values per pass over the output tiles: 16 KB at D = 256 stays in L1

struct Scratch {
  std::vector<uint32_t> qp, pp;
  std::vector<float> s, o;  // scores [keys, 16] ([16, keys] with AMX); outputs [16, D]
  std::vector<uint16_t> q, p;  // AMX: queries [16, D], probabilities [16, keys] bf16
};

// The 16 query vectors of a unit: their rows in the query and out tensors, their runs, and the
// union of the runs [klo, khi) (khi == 0: no vector sees anything).
struct UnitLanes {
  int64_t lo[kLanes], hi[kLanes];
  const uint16_t* qrow[kLanes];
  uint16_t* orow[kLanes];
  int64_t klo = INT64_MAX, khi = 0;
  int live = 0;  // vectors of the unit that exist (the last unit of a piece may have fewer)

  UnitLanes(const Geometry& G, const Piece& p, const int64_t* bounds, int64_t g, int64_t u) {
    const int64_t vectors = p.q_len * G.group;
    live = static_cast<int>(std::min<int64_t>(kLanes, vectors - u * kLanes));
    for (int l = 0; l < kLanes; ++l) {
      const int64_t v = u * kLanes + l, r = v / G.group;
      qrow[l] = nullptr;
      orow[l] = nullptr;
      lo[l] = hi[l] = 0;
      if (v >= vectors) continue;
      const int64_t h = g * G.group + v % G.group;
      qrow[l] = G.q + ((p.q_start + r) * G.H + h) * G.D;
      orow[l] = G.out + ((p.q_start + r) * G.H + h) * G.D;
      lo[l] = bounds[2 * (p.row_base + r)];
      hi[l] = bounds[2 * (p.row_base + r) + 1];
      if (lo[l] < hi[l]) {
        klo = std::min(klo, lo[l]);
        khi = std::max(khi, hi[l]);
      }
    }
    if (khi > 0) klo &= ~int64_t{1};  // key pairs start at even entries (the entry before is this piece's: p = 0)
  }

  // Where no vector sees anything, zeroes their outputs and says so (the unit is then done).
  bool zero_if_blind(int64_t D) const {
    if (khi > 0) return false;
    for (int l = 0; l < kLanes; ++l)
      if (orow[l] != nullptr) std::fill(orow[l], orow[l] + D, uint16_t{0});
    return true;
  }
};

// One work unit: query vectors [16 u, 16 u + 16) of piece p, kv head g, over its packed keys kp and values vp.
SPECMESH_DOT_TARGET void attend_unit(const Geometry& G, const Piece& p, const int64_t* bounds, int64_t g, int64_t u,
                                     const uint32_t* kp, const uint32_t* vp, Scratch& w) {
  const UnitLanes L(G, p, bounds, g, u);
  if (L.zero_if_blind(G.D)) return;
  const int64_t D = G.D, D2 = D / 2, klo = L.klo, khi = L.khi;
  const int64_t n = khi - klo;
  const int64_t* lo = L.lo;
  const int64_t* hi = L.hi;
  const uint16_t* const* qrow = L.qrow;
  uint16_t* const* orow = L.orow;

  w.qp.resize(D2 * kLanes);  // [D/2, 16]: lane l's (d, d+1) pair; absent lanes zero
  for (int64_t dp = 0; dp < D2; ++dp)
    for (int l = 0; l < kLanes; ++l) {
      uint32_t pair = 0;
      if (qrow[l] != nullptr) std::memcpy(&pair, qrow[l] + 2 * dp, sizeof(pair));
      w.qp[dp * kLanes + l] = pair;
    }

  // Whole key tiles: the first may start before klo, the last run past khi (into the next
  // entries or the packed keys' zero padding): scores no lane sees, masked below.
  const int64_t t0 = klo / kKeys, t1 = (khi + kKeys - 1) / kKeys;
  w.s.resize((t1 - t0) * kKeys * kLanes);
  for (int64_t t = t0; t < t1; ++t)
    score_tile(w.qp.data(), kp + t * D2 * kKeys, D2, G.scale, w.s.data() + (t - t0) * kKeys * kLanes);

  // Softmax over keys, lane by lane (each lane only over its own run), in float32.
  int32_t lo32[kLanes], hi32[kLanes];  // each lane's run, from klo
  for (int l = 0; l < kLanes; ++l) {
    lo32[l] = static_cast<int32_t>(lo[l] - klo);
    hi32[l] = static_cast<int32_t>(hi[l] - klo);
  }
  const __m512i lov = _mm512_loadu_si512(lo32), hiv = _mm512_loadu_si512(hi32);
  auto visible = [&](int64_t k) {  // lanes that see key klo + k
    const __m512i kv = _mm512_set1_epi32(static_cast<int32_t>(k));
    return static_cast<__mmask16>(_mm512_cmple_epi32_mask(lov, kv) & _mm512_cmplt_epi32_mask(kv, hiv));
  };
  float* s = w.s.data() + (klo - t0 * kKeys) * kLanes;  // key klo's scores
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t k = 0; k < n; ++k) mx = _mm512_mask_max_ps(mx, visible(k), mx, _mm512_loadu_ps(s + k * kLanes));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; ++k) {
    const __m512 e = _mm512_maskz_mov_ps(visible(k), exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + k * kLanes), mx)));
    _mm512_storeu_ps(s + k * kLanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __mmask16 seen = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(seen, _mm512_set1_ps(1.0f), sum);  // 0 where a lane sees nothing

  // bf16 probabilities as (key 2i, key 2i+1) pairs per lane: pp [(n + 1) / 2, 16].
  const int64_t pairs = (n + 1) / 2;
  w.pp.resize(pairs * kLanes);
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512i a = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(_mm512_mul_ps(_mm512_loadu_ps(s + 2 * i * kLanes), inv))), 16);
    __m512i b = _mm512_setzero_si512();
    if (2 * i + 1 < n)
      b = _mm512_castps_si512(round_bf16(_mm512_mul_ps(_mm512_loadu_ps(s + (2 * i + 1) * kLanes), inv)));
    _mm512_storeu_si512(w.pp.data() + i * kLanes, _mm512_or_si512(a, b));
  }

  // Values: the unit's outputs [16, D] float32 stay in L1 while a few key pairs of values are
  // run through every (4 vectors x 64 columns) tile, so each value is read once per unit.
  const int64_t i0 = klo / 2;  // first key pair, in the packed values
  const int live = L.live;
  w.o.assign(kLanes * D, 0.0f);
  for (int64_t c0 = 0; c0 < pairs; c0 += kPairsPerPass) {
    const int64_t c1 = std::min(pairs, c0 + kPairsPerPass);
    for (int lane0 = 0; lane0 < live; lane0 += 4)
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        value_tile(w.pp.data(), vp + i0 * D, c0, c1, D, lane0, d0, w.o.data());
  }
  for (int l = 0; l < live; ++l)
    for (int64_t d = 0; d < D; d += 16) store_bf16(orow[l] + d, round_bf16(_mm512_loadu_ps(w.o.data() + l * D + d)), 0xFFFF);
}

#define SPECMESH_AMX_ATTENTION_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// AMX's tile operands, all 16 rows of 64 bytes (specmesh_amx::begin's configuration): tmm0-3 float32
// sums, tmm4 the unit's rows (queries or probabilities), tmm5-7 the packed keys or values.

// Scores of the unit's queries (q [16, D] bf16) against NT packed key tiles from tile t (kp: the
// piece's packed keys) -> s[m * ld + (t - t0) * 16 + key], float32 sums (scaled and rounded later).
template <int NT>
SPECMESH_AMX_ATTENTION_TARGET void score_tiles_amx(const uint16_t* q, int64_t D, const uint32_t* kp, int64_t t,
                                                   int64_t t0, float* s, int64_t ld) {
  const int64_t D2 = D / 2;
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  for (int64_t dp = 0; dp < D2; dp += 16) {  // 16 d pairs a tile step
    _tile_loadd(4, q + 2 * dp, D * 2);
    _tile_loadd(5, kp + ((t + 0) * D2 + dp) * kKeys, kKeys * 4);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NT > 1) {
      _tile_loadd(6, kp + ((t + 1) * D2 + dp) * kKeys, kKeys * 4);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(7, kp + ((t + 2) * D2 + dp) * kKeys, kKeys * 4);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NT > 3) {
      _tile_loadd(5, kp + ((t + 3) * D2 + dp) * kKeys, kKeys * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  float* row = s + (t - t0) * kKeys;
  _tile_stored(0, row, ld * 4);
  if constexpr (NT > 1) _tile_stored(1, row + kKeys, ld * 4);
  if constexpr (NT > 2) _tile_stored(2, row + 2 * kKeys, ld * 4);
  if constexpr (NT > 3) _tile_stored(3, row + 3 * kKeys, ld * 4);
}

// o[16, 64 columns from d0] = probabilities (pr [16, width] bf16, width a multiple of 32) times the
// packed values from pair i0 (vp: [pairs, D] (key 2i, key 2i+1) pairs), float32 sums.
SPECMESH_AMX_ATTENTION_TARGET void value_tiles_amx(const uint16_t* pr, int64_t width, const uint32_t* vp, int64_t i0,
                                                   int64_t D, int64_t d0, float* o) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < width; k += 32) {  // 32 keys (16 pairs) a tile step
    const uint32_t* v = vp + (i0 + k / 2) * D + d0;
    _tile_loadd(4, pr + k, width * 2);
    _tile_loadd(5, v, D * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, v + 16, D * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, v + 32, D * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, v + 48, D * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, o + d0, D * 4);
  _tile_stored(1, o + d0 + 16, D * 4);
  _tile_stored(2, o + d0 + 32, D * 4);
  _tile_stored(3, o + d0 + 48, D * 4);
}

// attend_unit on AMX tiles (the file's header): the same scores, softmax and rounding; the caller
// has loaded the tile configuration (specmesh_amx::begin) on this thread. The packed values must
// hold 16 pairs of zeros past each piece's last pair (a tile step reads up to 15 pairs past the run).
SPECMESH_AMX_ATTENTION_TARGET void attend_unit_amx(const Geometry& G, const Piece& p, const int64_t* bounds, int64_t g,
                                                   int64_t u, const uint32_t* kp, const uint32_t* vp, Scratch& w) {
  const UnitLanes L(G, p, bounds, g, u);
  if (L.zero_if_blind(G.D)) return;
  const int64_t D = G.D, klo = L.klo, khi = L.khi, n = khi - klo;

  w.q.resize(kLanes * D);  // [16, D]: absent lanes zero
  for (int l = 0; l < kLanes; ++l) {
    if (L.qrow[l] != nullptr) std::memcpy(w.q.data() + l * D, L.qrow[l], D * 2);
    else std::fill(w.q.data() + l * D, w.q.data() + (l + 1) * D, uint16_t{0});
  }

  // Whole key tiles [t0, t1), as attend_unit: keys outside a lane's run are masked below.
  const int64_t t0 = klo / kKeys, t1 = (khi + kKeys - 1) / kKeys, ld = (t1 - t0) * kKeys;
  w.s.resize(kLanes * ld);
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) score_tiles_amx<4>(w.q.data(), D, kp, t, t0, w.s.data(), ld);
  switch (t1 - t) {
    case 3: score_tiles_amx<3>(w.q.data(), D, kp, t, t0, w.s.data(), ld); break;
    case 2: score_tiles_amx<2>(w.q.data(), D, kp, t, t0, w.s.data(), ld); break;
    case 1: score_tiles_amx<1>(w.q.data(), D, kp, t, t0, w.s.data(), ld); break;
    default: break;
  }

  // Softmax row by row over each lane's run, in float32; bf16 probabilities [16, width] from key
  // klo, zero outside the run and past it (width: n rounded up to whole tile steps of 32 keys).
  const int64_t width = (n + 31) / 32 * 32, base = klo - t0 * kKeys;  // key klo's column in s
  w.p.resize(kLanes * width);
  const __m512 scale = _mm512_set1_ps(G.scale);
  for (int l = 0; l < kLanes; ++l) {
    uint16_t* pr = w.p.data() + l * width;
    const int64_t a = L.lo[l] - klo, b = L.hi[l] - klo;  // the run, from key klo
    if (a >= b) {
      std::fill(pr, pr + width, uint16_t{0});
      continue;
    }
    float* sr = w.s.data() + l * ld + base;
    auto run = [&](int64_t k) {  // lanes k .. k + 15 inside [a, b)
      const int64_t first = std::max<int64_t>(a - k, 0), last = std::min<int64_t>(b - k, 16);
      return first >= last ? __mmask16{0} : static_cast<__mmask16>(lanes(last) & ~lanes(first));
    };
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t k = a & ~int64_t{15}; k < b; k += 16) {
      const __mmask16 m = run(k);
      const __m512 x = round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + k), scale));
      _mm512_mask_storeu_ps(sr + k, m, x);
      mx = _mm512_mask_max_ps(mx, m, mx, x);
    }
    const __m512 mxv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = a & ~int64_t{15}; k < b; k += 16) {
      const __mmask16 m = run(k);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + k), mxv)));
      _mm512_mask_storeu_ps(sr + k, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t k = 0; k < width; k += 16) {
      const __mmask16 m = run(k);
      const __m512 e = _mm512_maskz_loadu_ps(m, sr + k);
      store_bf16(pr + k, _mm512_maskz_mov_ps(m, round_bf16(_mm512_mul_ps(e, inv))), 0xFFFF);
    }
  }

  // Values: 64 columns of d at a time (four float32 tiles), every tile step of probabilities.
  w.o.resize(kLanes * D);
  for (int64_t d0 = 0; d0 < D; d0 += 64) value_tiles_amx(w.p.data(), width, vp, klo / 2, D, d0, w.o.data());
  for (int l = 0; l < L.live; ++l)
    for (int64_t d = 0; d < D; d += 16)
      store_bf16(L.orow[l] + d, round_bf16(_mm512_loadu_ps(w.o.data() + l * D + d)), 0xFFFF);
}

}  // namespace

// query [T, H, D] bf16; k_cache, v_cache [num_blocks, block_size, KV, D] bf16; pieces [P, 4] int64
// (q_start, q_len, kv_offset, kv_len): the piece's rows are query rows q_start .. q_start + q_len - 1
// and its kv range the entries kv_offset .. kv_offset + kv_len - 1 of its blocks (tables[P,
// max_blocks]) laid end to end; bounds [sum q_len, 2] int64: row by row, piece after piece, the
// run [lo, hi) of that range the row sees (lo == hi: none). Writes those rows of out ([T, H, D]
// bf16). The caller checks the CPU has AVX512-BF16 (cpu_linear.bf16_dot_instruction); amx: the
// units on AMX tiles (the caller checks cpu_linear.amx()).
void chunk_attention_bf16(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& pieces, const at::Tensor& tables, const at::Tensor& bounds, double scale,
                          at::Tensor& out, bool amx) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "chunk_attention_bf16: this CPU has no AVX512-BF16");
  TORCH_CHECK(!amx || amx_ready(), "chunk_attention_bf16: amx=True, but this process has no AMX tile registers");
  specmesh_checks::check_paged_bf16("chunk_attention_bf16", query, k_cache, v_cache, out, 64);
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), BS = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(pieces.scalar_type() == at::kLong && pieces.dim() == 2 && pieces.size(1) == 4 && pieces.is_contiguous(),
              "chunk_attention_bf16: pieces int64 [P, 4]");
  const int64_t P = pieces.size(0);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == P && tables.is_contiguous(),
              "chunk_attention_bf16: tables int64 [P, max_blocks]");
  TORCH_CHECK(bounds.scalar_type() == at::kLong && bounds.dim() == 2 && bounds.size(1) == 2 && bounds.is_contiguous(),
              "chunk_attention_bf16: bounds int64 [rows, 2]");
  const int64_t* pc = pieces.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* bp = bounds.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1), num_blocks = k_cache.size(0);
  std::vector<Piece> ps(P);
  int64_t rows = 0;
  for (int64_t i = 0; i < P; ++i) {  // every index is checked before any is read
    Piece& p = ps[i];
    p = {pc[4 * i], pc[4 * i + 1], pc[4 * i + 2], pc[4 * i + 3], rows};
    TORCH_CHECK(p.q_start >= 0 && p.q_len > 0 && p.q_start + p.q_len <= T && p.kv_offset >= 0 && p.kv_len > 0
                    && p.kv_offset + p.kv_len <= max_blocks * BS && p.kv_len < (int64_t{1} << 30),
                "chunk_attention_bf16: piece ", i, " out of range");
    for (int64_t b = p.kv_offset / BS; b <= (p.kv_offset + p.kv_len - 1) / BS; ++b)
      TORCH_CHECK(tp[i * max_blocks + b] >= 0 && tp[i * max_blocks + b] < num_blocks,
                  "chunk_attention_bf16: block id out of range in piece ", i);
    rows += p.q_len;
  }
  TORCH_CHECK(bounds.size(0) == rows, "chunk_attention_bf16: bounds must have one row per query row of the pieces");
  for (const Piece& p : ps)
    for (int64_t r = 0; r < p.q_len; ++r) {
      const int64_t lo = bp[2 * (p.row_base + r)], hi = bp[2 * (p.row_base + r) + 1];
      TORCH_CHECK(0 <= lo && lo <= hi && hi <= p.kv_len, "chunk_attention_bf16: row ", p.row_base + r,
                  " sees outside its piece's kv range");
    }
  if (P == 0) return;

  const int64_t group = H / KV;
  std::vector<uint16_t> zero(D, 0);
  Geometry G{reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
             zero.data(),
             reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
             tp, max_blocks, H, D, BS, KV, group, static_cast<float>(scale)};

  // Keys and values, packed per piece and kv head (each piece's rows read them many times). The
  // values end in kValuePad pairs of zeros (an AMX tile step reads up to 15 pairs past a run).
  constexpr int64_t kValuePad = 16;
  std::vector<int64_t> kstart(P * KV + 1, 0), vstart(P * KV + 1, 0);
  for (int64_t j = 0; j < P * KV; ++j) {
    const int64_t len = ps[j / KV].kv_len;
    kstart[j + 1] = kstart[j] + (len + kKeys - 1) / kKeys * kKeys * D / 2;  // whole tiles
    vstart[j + 1] = vstart[j] + ((len + 1) / 2 + kValuePad) * D;
  }
  // Kept between calls (per calling thread): fresh megabytes each call cost page faults.
  thread_local std::vector<uint32_t> kpacked;
  thread_local std::vector<uint32_t> vpacked;
  kpacked.assign(kstart.back(), 0);
  vpacked.resize(vstart.back());
  for (int64_t j = 0; j < P * KV; ++j)
    std::fill(vpacked.begin() + vstart[j + 1] - kValuePad * D, vpacked.begin() + vstart[j + 1], uint32_t{0});
  uint32_t* kbuf = kpacked.data();  // (a thread_local named in a worker is the worker's own)
  uint32_t* vbuf = vpacked.data();
  // Entries some row of a piece sees: a difference array of its rows' runs.
  std::vector<int64_t> sstart(P + 1, 0);
  for (int64_t i = 0; i < P; ++i) sstart[i + 1] = sstart[i] + ps[i].kv_len;
  std::vector<char> seen(sstart.back());
  {
    std::vector<int32_t> runs;
    for (int64_t i = 0; i < P; ++i) {
      const Piece& p = ps[i];
      runs.assign(p.kv_len + 1, 0);
      for (int64_t r = 0; r < p.q_len; ++r) {
        runs[bp[2 * (p.row_base + r)]] += 1;
        runs[bp[2 * (p.row_base + r) + 1]] -= 1;
      }
      for (int64_t e = 0, open = 0; e < p.kv_len; ++e) seen[sstart[i] + e] = (open += runs[e]) > 0;
    }
  }
  constexpr int64_t kPackSpan = 256;  // entries per packing job (a long piece is packed by every thread)
  std::vector<int64_t> pstart(P * KV + 1, 0);
  for (int64_t j = 0; j < P * KV; ++j) pstart[j + 1] = pstart[j] + (ps[j / KV].kv_len + kPackSpan - 1) / kPackSpan;
  at::parallel_for(0, pstart.back(), 1, [&](int64_t begin, int64_t end) {
    int64_t j = std::upper_bound(pstart.begin(), pstart.end(), begin) - pstart.begin() - 1;
    for (int64_t job = begin; job < end; ++job) {
      while (job >= pstart[j + 1]) ++j;
      const Piece& p = ps[j / KV];
      const int64_t e0 = (job - pstart[j]) * kPackSpan, e1 = std::min(p.kv_len, e0 + kPackSpan);
      pack_piece(G, j / KV, p, j % KV, seen.data() + sstart[j / KV], e0, e1, kbuf + kstart[j], vbuf + vstart[j]);
    }
  });

  // Work units: (piece, kv head, 16 query vectors).
  std::vector<int64_t> ustart(P * KV + 1, 0);
  for (int64_t j = 0; j < P * KV; ++j) ustart[j + 1] = ustart[j] + (ps[j / KV].q_len * group + kLanes - 1) / kLanes;
  // Units differ in work (a causal chunk's later rows see more keys): handed out one by one.
  const int64_t units = ustart.back();
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units)))
  {
    thread_local Scratch w;
    if (amx) specmesh_amx::begin();
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < units; ++unit) {
      const int64_t j = std::upper_bound(ustart.begin(), ustart.end(), unit) - ustart.begin() - 1;
      if (amx) attend_unit_amx(G, ps[j / KV], bp, j % KV, unit - ustart[j], kbuf + kstart[j], vbuf + vstart[j], w);
      else attend_unit(G, ps[j / KV], bp, j % KV, unit - ustart[j], kbuf + kstart[j], vbuf + vstart[j], w);
    }
    if (amx) specmesh_amx::end();
  }
}

#endif  // SPECMESH_ISA_AVX512
