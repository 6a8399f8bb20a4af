// The packed weight layout of the bf16 linear kernels (cpu_linear.cpp, cpu_amx_linear.cpp): panels of
// 32 output columns and pairs of k, [P = ceil(N/32), K2 = ceil(K/2), 64] bf16; within [p, kk], slots
// 0-31 hold columns 0-15 as (k = 2kk, 2kk + 1) pairs, slots 32-63 columns 16-31 likewise.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_simd.h"

namespace specmesh_panels {

constexpr int64_t kPanel = 32;              // output columns per panel: two 16-lane float32 vectors (four 8-lane)
constexpr int64_t kPairSlots = 2 * kPanel;  // bf16 values per [panel, k pair]

#if defined(SPECMESH_ISA_AVX512)
// buf's rows [0, rows) of panel p (32 float32 each) -> y[m, p * 32 ...] bf16 (row stride N), up to N.
inline void write_panel(const float* buf, int64_t rows, int64_t p, int64_t N, uint16_t* y) {
  const int64_t n0 = p * kPanel, valid = std::min<int64_t>(kPanel, N - n0);
  const __mmask16 m0 = specmesh_simd::lanes(valid), m1 = specmesh_simd::lanes(std::max<int64_t>(valid - 16, 0));
  for (int64_t m = 0; m < rows; ++m) {
    specmesh_simd::store_bf16(y + m * N + n0, specmesh_simd::round_bf16(_mm512_loadu_ps(buf + m * kPanel)), m0);
    specmesh_simd::store_bf16(y + m * N + n0 + 16, specmesh_simd::round_bf16(_mm512_loadu_ps(buf + m * kPanel + 16)), m1);
  }
}
#endif

}  // namespace specmesh_panels
