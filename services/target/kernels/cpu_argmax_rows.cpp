// The greedy token of each row of float32 logits: torch.argmax's answer (the first index of the
// largest value) in one vectorized pass, for the sampler (services/target/model/sampler.py).
//
// Why: torch's CPU argmax over a [rows, 262,144] float32 batch ran at about 1 ns an element, ~4 ms
// for an 18-row step of the default model, 7% of the target's busy time in the 18-request batch
// (python -m benchmarks.mesh_batch_profile); this pass reads the logits at memory speed.
//
// A row's answer is torch's only where the row has no NaN and its largest value is finite: `ok`
// says so per row, and the caller keeps its own handling of the other rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

#if defined(SPECMESH_ISA_AVX512)

constexpr int kLanes = 16;
constexpr int kChains = 4;  // independent (max, index) chains: a compare-and-blend's latency each step

// (first index of the largest value, whether the row has no NaN and that value is finite)
std::pair<int64_t, bool> argmax_row(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best[kChains];
  __m512i where[kChains];
  __mmask16 nan = 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int c = 0; c < kChains; ++c) {
    best[c] = neg_inf;
    where[c] = _mm512_add_epi32(lane, _mm512_set1_epi32(c * kLanes));
  }
  // Each lane of a chain keeps the first of its own positions that holds its largest value (a strict
  // compare: a later equal value does not replace it); NaN compares false and is only counted.
  int64_t j = 0;
  for (; j + kChains * kLanes <= n; j += kChains * kLanes) {
    for (int c = 0; c < kChains; ++c) {
      const __m512 v = _mm512_loadu_ps(x + j + c * kLanes);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best[c], _CMP_GT_OQ);
      best[c] = _mm512_mask_mov_ps(best[c], gt, v);
      where[c] = _mm512_mask_mov_epi32(where[c], gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j + c * kLanes))));
    }
  }
  for (; j < n; j += kLanes) {  // the tail, on chain 0 (its positions come after every chain's)
    const __mmask16 valid = n - j >= kLanes ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, valid, x + j);
    nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best[0], _CMP_GT_OQ);
    best[0] = _mm512_mask_mov_ps(best[0], gt, v);
    where[0] = _mm512_mask_mov_epi32(where[0], gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j))));
  }
  // The largest value over every chain and lane, then the smallest index holding it: each (chain,
  // lane) holds the first of its positions with its own largest, so the smallest among those equal
  // to the row's largest is the row's first.
  __m512 top = best[0];
  for (int c = 1; c < kChains; ++c) top = _mm512_max_ps(top, best[c]);
  const float m = _mm512_reduce_max_ps(top);
  int64_t index = std::numeric_limits<int32_t>::max();
  for (int c = 0; c < kChains; ++c) {
    const __mmask16 eq = _mm512_cmp_ps_mask(best[c], _mm512_set1_ps(m), _CMP_EQ_OQ);
    if (eq) index = std::min<int64_t>(index, _mm512_mask_reduce_min_epi32(eq, where[c]));
  }
  if (index >= n) index = 0;  // every value -inf: torch's 0 (and not ok)
  return {index, nan == 0 && std::isfinite(m)};
}

#else  // SPECMESH_ISA_AVX2: the same answer, one element at a time

std::pair<int64_t, bool> argmax_row(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t index = 0;
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    nan |= std::isnan(x[j]);
    if (x[j] > m) {
      m = x[j];
      index = j;
    }
  }
  return {index, !nan && std::isfinite(m)};
}

#endif

}  // namespace

// logits [M, N] float32, contiguous -> (index [M] int64, ok [M] bool)
std::tuple<at::Tensor, at::Tensor> argmax_rows_f32(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows_f32: contiguous float32 logits [M, N] expected");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < std::numeric_limits<int32_t>::max(),
              "argmax_rows_f32: 0 < N < 2^31 expected");
  const int64_t M = logits.size(0), N = logits.size(1);
  at::Tensor index = at::empty({M}, logits.options().dtype(at::kLong));
  at::Tensor ok = at::empty({M}, logits.options().dtype(at::kBool));
  const float* x = logits.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  bool* okp = ok.data_ptr<bool>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto [i, good] = argmax_row(x + r * N, N);
      ip[r] = i;
      okp[r] = good;
    }
  });
  return {index, ok};
}
