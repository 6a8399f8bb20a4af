// Attention of single query rows over the paged bf16 KV pool, read in place: no gather of blocks,
// no padding, one call for every such row of a layer. Decode rows see every entry of their kv
// range; rows of draft trees and short chunks see the entries their mask row allows. torch's
// path spends most of such a layer in dispatch (SDPA ~80 us for one decode row at 200 entries,
// ~15 ops for a 6-row tree, 2026-11-30); this is a few microseconds a row.
//
// Precision: that of the bf16 matmul path in paged_attention_cpu.py (and Hugging Face's eager
// bf16 attention): scores = bf16(scale * q.k) with float32 sums, softmax in float32, bf16
// probabilities, out = bf16(sum p * v) with float32 sums. Only the order of the float32 sums
// differs, so an output can differ by one bf16 rounding step (tests/kernels/test_cpu_decode_attention.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

inline __m512 widen(const uint16_t* p) {  // 16 bf16 -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline float round_bf16(float f) {  // round to nearest even, as c10::BFloat16 (NaN -> NaN)
  if (std::isnan(f)) return f;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t to_bf16_bits(float f) {
  const float r = round_bf16(f);
  uint32_t bits;
  std::memcpy(&bits, &r, 4);
  return std::isnan(f) ? 0x7FC0 : static_cast<uint16_t>(bits >> 16);
}

}  // namespace

// query [T, H, D] bf16; k_cache, v_cache [num_blocks, block_size, KV, D] bf16; for n decode rows:
// rows [n] (query row), tables [n, max_blocks] (block ids), offsets [n] and lens [n] (the visible
// entries offsets[i] .. offsets[i] + lens[i] - 1 of the row's blocks laid end to end), masks
// [n, >= max lens] bool (entry j of that range visible iff masks[i, j]) or empty (all visible).
// Writes out[rows[i]] ([T, H, D] bf16); a row that sees no entry gets zeros. Entries a row may
// not see are never read (a freed block's stale KV may be NaN).
void decode_attention_bf16(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& offsets,
                           const at::Tensor& lens, const at::Tensor& masks, double scale, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && query.is_contiguous(),
              "decode_attention_bf16: contiguous bf16 query [T, H, D] expected");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous()
                  && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kBFloat16 && v_cache.is_contiguous(),
              "decode_attention_bf16: contiguous bf16 caches [blocks, block_size, KV, D] of one shape expected");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
              "decode_attention_bf16: out must be like query");
  const int64_t H = query.size(1), D = query.size(2), BS = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && H % KV == 0,
              "decode_attention_bf16: head_dim a multiple of 16, equal in query and cache, and heads a multiple of kv heads expected");
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

  at::parallel_for(0, n * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs, qf;
    std::vector<const uint16_t*> vrows;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / KV, g = job % KV, len = lp[i], h0 = g * group;
      const uint16_t* qrow = q + (rp[i] * H + h0) * D;  // the group's query heads, [group, D]
      qf.resize(group * D);  // ... in float32 (exact)
      for (int64_t d = 0; d < group * D; d += 16) _mm512_storeu_ps(qf.data() + d, widen(qrow + d));
      probs.assign(group * len, 0.0f);
      vrows.assign(len, nullptr);  // nullptr: an entry the row may not see
      const bool* mrow = masked ? mp + i * mask_width : nullptr;
      for (int64_t j = 0; j < len; ++j) {
        if (mrow != nullptr && !mrow[j]) {
          for (int64_t hh = 0; hh < group; ++hh) probs[hh * len + j] = -INFINITY;
          continue;
        }
        const int64_t e = op[i] + j, slot = (tp[i * max_blocks + e / BS] * BS + e % BS) * KV + g;
        const uint16_t* krow = kc + slot * D;
        vrows[j] = vc + slot * D;
        for (int64_t h1 = 0; h1 < group; h1 += 4) {  // up to 4 query heads per pass over k
          const int64_t heads = std::min<int64_t>(4, group - h1);
          __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t d = 0; d < D; d += 16) {
            const __m512 kv = widen(krow + d);
            for (int64_t hh = 0; hh < heads; ++hh)
              acc[hh] = _mm512_fmadd_ps(_mm512_loadu_ps(qf.data() + (h1 + hh) * D + d), kv, acc[hh]);
          }
          for (int64_t hh = 0; hh < heads; ++hh)  // the bf16 score
            probs[(h1 + hh) * len + j] = round_bf16(_mm512_reduce_add_ps(acc[hh]) * sc);
        }
      }
      if (std::all_of(vrows.begin(), vrows.end(), [](const uint16_t* v) { return v == nullptr; })) {
        std::fill(o + (rp[i] * H + h0) * D, o + (rp[i] * H + h0 + group) * D, uint16_t{0});  // sees nothing
        continue;
      }
      for (int64_t hh = 0; hh < group; ++hh) {  // softmax in float32, probabilities rounded to bf16
        float* p = probs.data() + hh * len;
        const float mx = *std::max_element(p, p + len);
        float sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) sum += (p[j] = std::exp(p[j] - mx));  // exp(-inf) = 0
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < len; ++j) p[j] = round_bf16(p[j] * inv);
      }
      for (int64_t d = 0; d < D; d += 64) {  // out = sum_j p_j v_j, 64 columns at a time
        const int64_t width = std::min<int64_t>(64, D - d);
        for (int64_t hh = 0; hh < group; ++hh) {
          __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          const float* p = probs.data() + hh * len;
          for (int64_t j = 0; j < len; ++j) {
            if (vrows[j] == nullptr) continue;
            const __m512 pj = _mm512_set1_ps(p[j]);
            for (int64_t c = 0; c < width / 16; ++c) acc[c] = _mm512_fmadd_ps(pj, widen(vrows[j] + d + 16 * c), acc[c]);
          }
          uint16_t* orow = o + (rp[i] * H + h0 + hh) * D + d;
          alignas(64) float buf[64];
          for (int64_t c = 0; c < width / 16; ++c) _mm512_store_ps(buf + 16 * c, acc[c]);
          for (int64_t c = 0; c < width; ++c) orow[c] = to_bf16_bits(buf[c]);
        }
      }
    }
  });
}
