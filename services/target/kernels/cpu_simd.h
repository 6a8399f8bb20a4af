// SIMD helpers shared by the CPU kernels (cpu_linear.cpp, cpu_rowops.cpp, cpu_decode_attention.cpp,
// cpu_chunk_attention.cpp): bf16 <-> float32 lanes with torch's rounding, tail masks, and a
// vectorized exp. The module is built for one instruction set, named by a define from
// cpu_kernels.py: SPECMESH_ISA_AVX512 (16 lanes, below) or SPECMESH_ISA_AVX2 (AVX2 + FMA + F16C,
// 8 lanes: cpu_simd_avx2.h). Each kernel file keeps its AVX-512 loops and its AVX2 loops apart
// behind the same define.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(SPECMESH_ISA_AVX2)
#include "cpu_simd_avx2.h"
#elif !defined(SPECMESH_ISA_AVX512)
#error "build with -DSPECMESH_ISA_AVX512 or -DSPECMESH_ISA_AVX2 (services/target/kernels/cpu_kernels.py)"
#else

// Functions that use VDPBF16PS (AVX512-BF16) are compiled for it one by one; the module's flags
// stop at AVX-512 F/BW/DQ/VL, and callers check the CPU before calling them.
#define SPECMESH_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))

namespace specmesh_simd {

inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {  // 16 bf16 -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// float32 -> bf16 (round to nearest even, NaN -> 0x7FC0, as c10::BFloat16), as float32 again.
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}

inline void store_bf16(uint16_t* p, __m512 rounded, __mmask16 m) {  // a round_bf16 result
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}

inline __mmask16 lanes(int64_t left) {  // the first min(left, 16) lanes; none for left <= 0
  return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for float32 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7
// (relative error < 2e-7 before the final rounding), times 2^n. Inputs clamped to [-88, 88].
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace specmesh_simd

#endif  // SPECMESH_ISA_AVX512
