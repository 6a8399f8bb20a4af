// Attention of single query rows over the paged bf16 KV pool, read in place: no gather of blocks,
// no padding, one call for every such row of a layer. Decode rows see every entry of their kv
// range; rows of draft trees and short chunks see the entries their mask row allows. torch's
// path spends most of such a layer in dispatch (docs/kernels.md); this is a few microseconds a row.
//
// Precision: that of the bf16 matmul path in paged_attention_cpu.py (and Hugging Face's eager
// bf16 attention): scores = bf16(scale * q.k) with float32 sums, softmax in float32, bf16
// probabilities, out = bf16(sum p * v) with float32 sums. Only the order of the float32 sums
// differs, so an output can differ by one bf16 rounding step (tests/kernels/test_cpu_decode_attention.py).
//
// The per-head loops exist twice, behind the module's ISA define (cpu_simd.h): AVX-512 here,
// AVX2 in cpu_decode_attention_avx2.h, with the same names and arithmetic; the entry point is shared.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_paged_checks.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

#if defined(SPECMESH_ISA_AVX2)
#include "cpu_decode_attention_avx2.h"  // the same loops, 8 lanes
#else  // SPECMESH_ISA_AVX512

namespace {

using namespace specmesh_simd;

inline __m512 widen(const uint16_t* p) { return load_bf16(p, 0xFFFF); }  // 16 bf16 -> float32

// Key and value rows sit in blocks wherever the pool put them, so the hardware prefetcher, which
// follows one stream, loses the thread at every block boundary: the row kPrefetchRows on (its
// values [d, d + n)) is asked for ahead; a row past the range, or one not seen, is skipped.
constexpr int64_t kPrefetchRows = 8;
inline void prefetch_row(const uint16_t* const* rows, int64_t j, int64_t len, int64_t d, int64_t n) {
  if (j >= len || rows[j] == nullptr) return;
  const char* p = reinterpret_cast<const char*>(rows[j] + d);
  for (int64_t b = 0; b < n * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// n bf16 values (n a multiple of 16) -> float32 (exact).
inline void widen_row(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(dst + d, widen(src + d));
}

// The bf16 scores of G query heads (qf [G, D] float32) against one key row: scale * q.k, float32
// sums, rounded to bf16; written to out[g * stride]. G is a template argument so the G
// accumulators stay in registers.
template <int G>
inline void head_scores(const float* qf, const uint16_t* krow, int64_t D, float scale, float* out, int64_t stride) {
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 k = widen(krow + d);
    for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + d), k, acc[g]);
  }
  for (int g = 0; g < G; ++g) {
    const __m512 s = round_bf16(_mm512_set1_ps(_mm512_reduce_add_ps(acc[g]) * scale));
    out[g * stride] = _mm512_cvtss_f32(s);
  }
}

// out[g, d .. d + 16 C) = bf16(sum_j probs[g, j] v_j[d ..]) for G heads (probs [G, len], a null
// vrows[j] skipped); each value row is widened once for the G heads.
template <int G, int C>
inline void weighted_values(const float* probs, int64_t len, const uint16_t* const* vrows, int64_t d,
                            uint16_t* out, int64_t D) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    prefetch_row(vrows, j + kPrefetchRows, len, d, 16 * C);
    if (vrows[j] == nullptr) continue;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = widen(vrows[j] + d + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * len + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store_bf16(out + g * D + d + 16 * c, round_bf16(acc[g][c]), 0xFFFF);
}

// head_scores for J key rows at once: each key's sums are head_scores' (the same FMAs in the same
// order), in J x G independent chains instead of G, each query vector loaded once for the J keys.
// One key's chain is D / 16 dependent FMAs, so one key at a time waits on their latency.
template <int G, int J>
inline void head_scores_keys(const float* qf, const uint16_t* const* krows, int64_t D, float scale, float* out,
                             int64_t stride) {
  __m512 acc[J][G];
  for (int j = 0; j < J; ++j)
    for (int g = 0; g < G; ++g) acc[j][g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 k[J];
    for (int j = 0; j < J; ++j) k[j] = widen(krows[j] + d);
    for (int g = 0; g < G; ++g) {
      const __m512 qv = _mm512_loadu_ps(qf + g * D + d);
      for (int j = 0; j < J; ++j) acc[j][g] = _mm512_fmadd_ps(qv, k[j], acc[j][g]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int g = 0; g < G; ++g)
      out[g * stride + j] = _mm512_cvtss_f32(round_bf16(_mm512_set1_ps(_mm512_reduce_add_ps(acc[j][g]) * scale)));
}

// Heads [h, h + G) of a job: every score, then (after the softmax) every output column.
template <int G>
void head_block_scores(const float* qf, const uint16_t* const* krows, int64_t len, int64_t D, float scale,
                       float* probs) {
  constexpr int J = G <= 2 ? 4 : 2;  // keys at once: J x G chains, within the registers
  for (int64_t j = 0; j < len;) {
    bool run = j + J <= len;  // J keys in a row that the row sees: one head_scores_keys
    for (int64_t a = 0; run && a < J; ++a) run = krows[j + a] != nullptr;
    const int64_t keys = run ? J : 1;
    for (int64_t a = 0; a < keys; ++a) prefetch_row(krows, j + a + kPrefetchRows, len, 0, D);
    if (run) head_scores_keys<G, J>(qf, krows + j, D, scale, probs + j, len);
    else if (krows[j] != nullptr) head_scores<G>(qf, krows[j], D, scale, probs + j, len);
    j += keys;
  }
}

template <int G>
void head_block_values(const float* probs, int64_t len, const uint16_t* const* vrows, uint16_t* out, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) weighted_values<G, 4>(probs, len, vrows, d, out, D);
  for (; d < D; d += 16) weighted_values<G, 1>(probs, len, vrows, d, out, D);
}

// Softmax of one head's scores in place (float32; -inf entries become 0), rounded to bf16.
inline void softmax_row(float* p, int64_t len) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < len; j += 16) {  // a masked load: never past the row's end
    const __mmask16 m = lanes(len - j);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, p + j));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 m = lanes(len - j);
    const __m512 x = _mm512_maskz_loadu_ps(m, p + j);
    const __mmask16 live = m & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(x, top)));
    _mm512_mask_storeu_ps(p + j, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 m = lanes(len - j);
    _mm512_mask_storeu_ps(p + j, m, round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), inv)));
  }
}

}  // namespace

#endif  // SPECMESH_ISA_AVX512

// query [T, H, D] bf16; k_cache, v_cache [num_blocks, block_size, KV, D] bf16; for n decode rows:
// rows [n] (query row), tables [n, max_blocks] (block ids), offsets [n] and lens [n] (the visible
// entries offsets[i] .. offsets[i] + lens[i] - 1 of the row's blocks laid end to end), masks
// [n, >= max lens] bool (entry j of that range visible iff masks[i, j]) or empty (all visible).
// Writes out[rows[i]] ([T, H, D] bf16); a row that sees no entry gets zeros. Entries a row may
// not see are never read (a freed block's stale KV may be NaN).
void decode_attention_bf16(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& offsets,
                           const at::Tensor& lens, const at::Tensor& masks, double scale, at::Tensor& out) {
  specmesh_checks::check_paged_bf16("decode_attention_bf16", query, k_cache, v_cache, out, 16);
  const int64_t H = query.size(1), D = query.size(2), BS = k_cache.size(1), KV = k_cache.size(2);
  const int64_t n = rows.size(0);
  for (const at::Tensor* t : {&rows, &offsets, &lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == n && t->is_contiguous(),
                "decode_attention_bf16: rows, offsets and lens int64 [n]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == n && tables.is_contiguous(),
              "decode_attention_bf16: tables int64 [n, max_blocks]");
  const bool masked = masks.numel() > 0;
  TORCH_CHECK(!masked || (masks.scalar_type() == at::kBool && masks.dim() == 2 && masks.size(0) == n && masks.is_contiguous()),
              "decode_attention_bf16: masks bool [n, max_len] or empty");
  const bool* mp = masked ? masks.data_ptr<bool>() : nullptr;
  const int64_t mask_width = masked ? masks.size(1) : 0;
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1), T = query.size(0), num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < n; ++i) {  // every index is checked before any is read
    TORCH_CHECK(rp[i] >= 0 && rp[i] < T && op[i] >= 0 && lp[i] > 0 && op[i] + lp[i] <= max_blocks * BS
                    && (!masked || lp[i] <= mask_width),
                "decode_attention_bf16: row ", i, " out of range");
    for (int64_t b = op[i] / BS; b <= (op[i] + lp[i] - 1) / BS; ++b)
      TORCH_CHECK(tp[i * max_blocks + b] >= 0 && tp[i * max_blocks + b] < num_blocks,
                  "decode_attention_bf16: block id out of range in row ", i);
  }
  const int64_t group = H / KV;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float sc = static_cast<float>(scale);

  // A job: one row's kv head and some of its query heads. Fewer (row, kv head) pairs than threads
  // (one sequence decoding, one kv head: the default model) split each pair's query heads, so every
  // thread works: each head's arithmetic is the same whichever job computes it.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = n * KV < threads ? std::min<int64_t>(group, threads) : 1;
  at::parallel_for(0, n * KV * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs, qf;
    std::vector<const uint16_t*> krows, vrows;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t pair = job / parts, part = job % parts, i = pair / KV, g = pair % KV, len = lp[i];
      const int64_t first = part * group / parts, heads = (part + 1) * group / parts - first;
      const int64_t h0 = g * group + first;  // this job's heads: h0 .. h0 + heads - 1
      const uint16_t* qrow = q + (rp[i] * H + h0) * D;  // those query heads, [heads, D]
      qf.resize(heads * D);  // ... in float32 (exact)
      widen_row(qrow, heads * D, qf.data());
      probs.assign(heads * len, -INFINITY);  // [heads, len]; -inf: an entry the row may not see
      krows.assign(len, nullptr);
      vrows.assign(len, nullptr);
      const bool* mrow = masked ? mp + i * mask_width : nullptr;
      bool any = false;
      for (int64_t j = 0; j < len; ++j) {
        if (mrow != nullptr && !mrow[j]) continue;
        const int64_t e = op[i] + j, slot = (tp[i * max_blocks + e / BS] * BS + e % BS) * KV + g;
        krows[j] = kc + slot * D;
        vrows[j] = vc + slot * D;
        any = true;
      }
      uint16_t* orow = o + (rp[i] * H + h0) * D;
      if (!any) {
        std::fill(orow, orow + heads * D, uint16_t{0});  // sees nothing
        continue;
      }
      for (int64_t h = 0; h < heads;) {  // heads in blocks of up to 4: accumulators in registers
        const int64_t block = std::min<int64_t>(4, heads - h);
        const float* qh = qf.data() + h * D;
        float* ph = probs.data() + h * len;
        if (block == 4) head_block_scores<4>(qh, krows.data(), len, D, sc, ph);
        else if (block == 3) head_block_scores<3>(qh, krows.data(), len, D, sc, ph);
        else if (block == 2) head_block_scores<2>(qh, krows.data(), len, D, sc, ph);
        else head_block_scores<1>(qh, krows.data(), len, D, sc, ph);
        for (int64_t hh = 0; hh < block; ++hh) softmax_row(ph + hh * len, len);
        if (block == 4) head_block_values<4>(ph, len, vrows.data(), orow + h * D, D);
        else if (block == 3) head_block_values<3>(ph, len, vrows.data(), orow + h * D, D);
        else if (block == 2) head_block_values<2>(ph, len, vrows.data(), orow + h * D, D);
        else head_block_values<1>(ph, len, vrows.data(), orow + h * D, D);
        h += block;
      }
    }
  });
}

// One layer's step of decode rows in one call: this step's keys and values key, value [T, KV, D] bf16
// into their pool slots (slots [T] int64, slot = block * block_size + offset; < 0: not stored),
// then decode_attention_bf16 over the pool -> out [T, H, D] (zeros where no row writes). The same
// stores and arithmetic as store_kv_reference and decode_attention_bf16 one after the other,
// without a dozen torch calls per layer between them (paged_attention_cpu.store_and_attend).
at::Tensor store_decode_attention_bf16(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                       at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                                       const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& offsets,
                                       const at::Tensor& lens, const at::Tensor& masks, double scale) {
  at::Tensor out = at::zeros_like(query);
  specmesh_checks::check_paged_bf16("store_decode_attention_bf16", query, k_cache, v_cache, out, 16);
  const int64_t T = query.size(0), KV = k_cache.size(2), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == KV && t->size(2) == D
                    && t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                "store_decode_attention_bf16: contiguous bf16 key and value [T, KV, D] expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "store_decode_attention_bf16: slots int64 [T] expected");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < num_slots, "store_decode_attention_bf16: slot ", sp[t], " out of range");
  const int64_t row = KV * D;  // bf16 values a slot holds
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  uint16_t* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  uint16_t* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0) continue;
    std::memcpy(kc + sp[t] * row, kp + t * row, row * sizeof(uint16_t));
    std::memcpy(vc + sp[t] * row, vp + t * row, row * sizeof(uint16_t));
  }
  decode_attention_bf16(query, k_cache, v_cache, rows, tables, offsets, lens, masks, scale, out);
  return out;
}
