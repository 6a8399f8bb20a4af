// AVX2 + FMA helpers of the CPU kernels (the SPECMESH_ISA_AVX2 build; cpu_simd.h includes this):
// 8 float32 lanes per vector. The same arithmetic as the AVX-512 helpers in cpu_simd.h: bf16 ->
// float32 by a 16-bit shift (exact), float32 -> bf16 rounded to nearest even (NaN -> 0x7FC0, as
// c10::BFloat16), and the same exp polynomial. AVX2 has no mask registers and no 16-bit masked
// loads or stores: a tail of n < 8 lanes goes through a small zeroed buffer instead.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace specmesh_simd {

constexpr int64_t kWidth = 8;  // float32 lanes per vector

inline int64_t tail(int64_t left) { return left >= kWidth ? kWidth : left <= 0 ? 0 : left; }  // min(left, 8), >= 0

// A vector mask of the first n lanes (n in 0 .. 8), for maskload/maskstore.
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 widen_bits(__m128i u16) {  // 8 bf16 bit patterns -> float32 (exact)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u16), 16));
}

inline __m256 load_bf16(const uint16_t* p) { return widen_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256 load_bf16(const uint16_t* p, int64_t n) {  // the first n (<= 8) lanes, zeros after
  if (n >= kWidth) return load_bf16(p);
  alignas(16) uint16_t buf[kWidth] = {};
  if (n > 0) std::memcpy(buf, p, n * sizeof(uint16_t));
  return widen_bits(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}

inline __m256 load_ps(const float* p, int64_t n) {  // the first n (<= 8) lanes, zeros after; never reads past them
  return n >= kWidth ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
}

inline void store_ps(float* p, __m256 v, int64_t n) {
  if (n >= kWidth) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lane_mask(n), v);
}

// float32 -> bf16 (round to nearest even), as float32 again; for inputs known not to be NaN (the GGUF
// kernel's weights: two operations fewer per vector on a compute-bound path).
inline __m256 round_bf16_finite(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                              _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// float32 -> bf16 (round to nearest even, NaN -> 0x7FC0, as c10::BFloat16), as float32 again.
inline __m256 round_bf16(__m256 v) {
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(round_bf16_finite(v), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

// The high halves of 8 round_bf16 results, in lane order (packus works per 128-bit half).
inline __m128i bf16_bits(__m256 rounded) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08));
}

inline void store_bf16(uint16_t* p, __m256 rounded) {  // a round_bf16 result, 8 lanes
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(rounded));
}

inline void store_bf16(uint16_t* p, __m256 rounded, int64_t n) {  // its first n (<= 8) lanes
  if (n >= kWidth) return store_bf16(p, rounded);
  alignas(16) uint16_t buf[kWidth];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), bf16_bits(rounded));
  if (n > 0) std::memcpy(p, buf, n * sizeof(uint16_t));
}

inline float reduce_add(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float reduce_max(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

inline __m256 pow2(__m256i n) {  // 2^n as float32, n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// exp(x) for float32 lanes, the AVX-512 helper's polynomial: x = n ln2 + r, |r| <= ln2 / 2, e^r by
// its Taylor polynomial to r^7, times 2^n. Inputs clamped to [-88, 88]. 2^n is applied in two
// exact factors (n can be -127, below the normal range), which rounds once as VSCALEFPS does.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);  // floor(n / 2), then n - floor(n / 2): both in [-64, 64]
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(_mm256_sub_epi32(ni, n1)));
}

}  // namespace specmesh_simd
