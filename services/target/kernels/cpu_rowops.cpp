// The lean forwards' per-row "glue" between the matmuls (Gemma 3's and the Llama family's), for bf16 activations on AVX-512 and AVX2 CPUs, in one pass
// per row instead of 5-10 torch ops: RMSNorm, the residual add fused with the next norm, the
// q/k norm fused with RoPE, and the MLP's GELU (tanh) times up. At one decode row a torch op costs a few microseconds whatever its
// size, so a layer's ~30 small ops cost more than its four weight-streaming matmuls but the
// lm_head's share; these cut a step's op count by about half (benchmarks/engine_step.py).
//
// Every elementwise step rounds to bf16 where torch's bf16 ops round (after each multiply and
// add of RoPE and of the residual add), so those steps equal torch's bit for bit; only the
// sum of squares of a norm is added in another order (16 float32 lanes, 8 in the AVX2 build, then
// across them), so a
// normed value can differ from torch.rms_norm's by one bf16 rounding step, and GELU's tanh comes
// from an exp polynomial: equal to torch's for gates above -3, within 1e-4 below, where 1 + tanh
// cancels in both (tests/test_cpu_rowops.py).
//
// The row loops below exist twice, behind the module's ISA define (cpu_simd.h): AVX-512 here,
// AVX2 in cpu_rowops_avx2.h, with the same names and arithmetic; the entry points are shared.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(SPECMESH_ISA_AVX2)
#include "cpu_rowops_avx2.h"  // the same row loops, 8 lanes
#else  // SPECMESH_ISA_AVX512

namespace {

using namespace specmesh_simd;

// 1 / sqrt(mean(x^2) + eps) of one row of D bf16 values.
inline float inv_rms(const uint16_t* x, int64_t D, float eps) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t j = 0; j < D; j += 16) {
    const __m512 v = load_bf16(x + j, lanes(D - j));
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  return 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(D) + eps);
}

// out[j] = bf16((x[j] * r) * w[j]), the rounding of torch.rms_norm(x.float(), w) .to(bf16).
inline void norm_row(const uint16_t* x, const float* w, float r, int64_t D, uint16_t* out) {
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 m = lanes(D - j);
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(load_bf16(x + j, m), rv), _mm512_maskz_loadu_ps(m, w + j));
    store_bf16(out + j, round_bf16(y), m);
  }
}

// The Llama family's RMSNorm: out[j] = bf16(bf16(x[j] * r) * w[j]) (normed and rounded, then times
// its bf16 weight, held here as float32: the product is exact before its rounding, as torch's bf16 mul).
inline void norm_row_weight_after(const uint16_t* x, const float* w, float r, int64_t D, uint16_t* out) {
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 m = lanes(D - j);
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(x + j, m), rv));
    store_bf16(out + j, round_bf16(_mm512_mul_ps(normed, _mm512_maskz_loadu_ps(m, w + j))), m);
  }
}

// One row of a plain residual add (the Llama family's): hn[j] = bf16(h[j] + a[j]).
inline void add_row(const uint16_t* hr, const uint16_t* ar, int64_t D, uint16_t* hn) {
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 m = lanes(D - j);
    store_bf16(hn + j, round_bf16(_mm512_add_ps(load_bf16(hr + j, m), load_bf16(ar + j, m))), m);
  }
}

// One row of the SwiGLU activation: out[j] = bf16(bf16(silu(gate[j])) * up[j]), silu(x) = x / (1 + exp(-x)).
inline void silu_mul_row(const uint16_t* row, int64_t I, uint16_t* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < I; j += 16) {
    const __mmask16 m = lanes(I - j);
    const __m512 g = load_bf16(row + j, m);
    const __m512 act = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store_bf16(out + j, round_bf16(_mm512_mul_ps(act, load_bf16(row + I + j, m))), m);
  }
}

// GELU, tanh approximation, in torch's float32 formula:
//   0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),  tanh(z) = 1 - 2 / (exp(2z) + 1)
// (tanh within ~1e-7 of the true value, as torch's is: 1 + tanh cancels where torch's does)
inline __m512 gelu_tanh(__m512 x) {
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
  const __m512 e = exp_ps(_mm512_add_ps(inner, inner));
  const __m512 tanh = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh));
}

// One row of the residual add: hn[j] = bf16(h[j] + bf16((a[j] * r) * w_a[j])).
inline void add_normed_row(const uint16_t* hr, const uint16_t* ar, const float* wa, float r_a, int64_t D, uint16_t* hn) {
  const __m512 ra = _mm512_set1_ps(r_a);
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 m = lanes(D - j);
    const __m512 normed = round_bf16(_mm512_mul_ps(_mm512_mul_ps(load_bf16(ar + j, m), ra), _mm512_maskz_loadu_ps(m, wa + j)));
    store_bf16(hn + j, round_bf16(_mm512_add_ps(load_bf16(hr + j, m), normed)), m);
  }
}

// RoPE of one normed head (D values, D even) with its position's cos/sin rows:
//   y = bf16(bf16(n * cos) + bf16(rotate_half(n) * sin))
inline void rope_row(const uint16_t* normed, const uint16_t* cp, const uint16_t* sp, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  // rotate_half: -n[j + D/2] in the first half, n[j - D/2] in the second
  for (int side = 0; side < 2; ++side) {
    const int64_t lo = side * half, shift = side ? -half : half;
    const __m512i sign = _mm512_set1_epi32(side ? 0 : static_cast<int>(0x80000000u));
    for (int64_t j = lo; j < lo + half; j += 16) {
      const __mmask16 m = lanes(lo + half - j);
      const __m512 n = load_bf16(normed + j, m);
      const __m512 rot = _mm512_castsi512_ps(_mm512_xor_si512(
          _mm512_castps_si512(load_bf16(normed + j + shift, m)), sign));
      const __m512 a = round_bf16(_mm512_mul_ps(n, load_bf16(cp + j, m)));
      const __m512 b = round_bf16(_mm512_mul_ps(rot, load_bf16(sp + j, m)));
      store_bf16(out + j, round_bf16(_mm512_add_ps(a, b)), m);
    }
  }
}

// One row of the MLP's activation: out[j] = bf16(bf16(gelu_tanh(gate[j])) * up[j]), row = gate | up.
inline void gelu_mul_row(const uint16_t* row, int64_t I, uint16_t* out) {
  for (int64_t j = 0; j < I; j += 16) {
    const __mmask16 m = lanes(I - j);
    const __m512 act = round_bf16(gelu_tanh(load_bf16(row + j, m)));
    store_bf16(out + j, round_bf16(_mm512_mul_ps(act, load_bf16(row + I + j, m))), m);
  }
}

// One row of masked_softmax_bf16_ in place: s [N] bf16, h [N] (nonzero: hidden) or null, row [N]
// float32 scratch.
inline void softmax_row(uint16_t* s, const uint8_t* h, int64_t N, float* row) {
  __m512 mxv16 = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 m = lanes(N - j);
    __m512 x = load_bf16(s + j, m);
    if (h != nullptr) {
      const __m128i hid = _mm_maskz_loadu_epi8(m, h + j);
      x = _mm512_mask_mov_ps(x, _mm_test_epi8_mask(hid, hid), _mm512_set1_ps(-INFINITY));
    }
    _mm512_mask_storeu_ps(row + j, m, x);
    mxv16 = _mm512_mask_max_ps(mxv16, m, mxv16, x);
  }
  const float mx = _mm512_reduce_max_ps(mxv16);
  if (mx == -INFINITY) {  // sees nothing
    std::fill(s, s + N, uint16_t{0});
    return;
  }
  __m512 sum = _mm512_setzero_ps();
  const __m512 mxv = _mm512_set1_ps(mx);
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 m = lanes(N - j);
    const __m512 x = _mm512_maskz_loadu_ps(m, row + j);
    // hidden entries (-inf) and lanes past N: exactly 0
    const __mmask16 live = m & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(x, mxv)));
    _mm512_mask_storeu_ps(row + j, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 m = lanes(N - j);
    store_bf16(s + j, round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), inv)), m);
  }
}

}  // namespace

#endif  // SPECMESH_ISA_AVX512

namespace {

const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bf16_ptr(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              what, ": bf16 [rows, D] with unit column stride expected, got ", x.sizes(), " ", x.scalar_type());
}

void check_weight(const at::Tensor& w, int64_t D, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(-1) == D && w.dim() <= 2,
              what, ": float32 contiguous weight [D] or [W, D] with D=", D, " expected, got ", w.sizes());
}

// One normed row in either family's rounding: Gemma's weight (1 + w) inside the float32 product
// (weight_after false), or the Llama family's bf16 weight after the normed row's rounding.
inline void norm_any(bool weight_after, const uint16_t* x, const float* w, float r, int64_t D, uint16_t* out) {
  if (weight_after) norm_row_weight_after(x, w, r, D, out);
  else norm_row(x, w, r, D, out);
}

}  // namespace

// x [R, D] bf16, w [D] or [W, D] float32 (row r uses w[r % W]) -> [R, D] bf16; weight_after: norm_any.
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps, bool weight_after) {
  check_rows(x, "rms_norm_bf16");
  const int64_t R = x.size(0), D = x.size(1);
  check_weight(w, D, "rms_norm_bf16");
  const int64_t W = w.dim() == 2 ? w.size(0) : 1;
  at::Tensor out = at::empty({R, D}, x.options());
  const uint16_t* xp = bf16_ptr(x);
  uint16_t* op = bf16_ptr(out);
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * x.stride(0);
      norm_any(weight_after, row, wp + (r % W) * D, inv_rms(row, D, static_cast<float>(eps)), D, op + r * D);
    }
  });
  return out;
}

// The residual add after a sublayer and the norm before the next:
//   h_new = bf16(h + bf16(rms_norm(a) * w_a)),  x = bf16(rms_norm(h_new) * w_next)
// or, with w_a empty (the Llama family: no norm after a sublayer), h_new = bf16(h + a).
// h, a [R, D] bf16; w_a [D] or empty, w_next [D] float32; weight_after: norm_any -> (h_new, x).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& h, const at::Tensor& a, const at::Tensor& w_a,
                                                     const at::Tensor& w_next, double eps, bool weight_after) {
  check_rows(h, "add_rms_norm_bf16");
  check_rows(a, "add_rms_norm_bf16");
  const int64_t R = h.size(0), D = h.size(1);
  TORCH_CHECK(a.size(0) == R && a.size(1) == D, "add_rms_norm_bf16: h and a differ in shape: ", h.sizes(), " ", a.sizes());
  const bool norm_a = w_a.numel() > 0;
  if (norm_a) check_weight(w_a, D, "add_rms_norm_bf16");
  check_weight(w_next, D, "add_rms_norm_bf16");
  TORCH_CHECK((!norm_a || w_a.dim() == 1) && w_next.dim() == 1, "add_rms_norm_bf16: one weight row each");
  at::Tensor h_new = at::empty({R, D}, h.options()), x = at::empty({R, D}, h.options());
  const uint16_t *hp = bf16_ptr(h), *ap = bf16_ptr(a);
  uint16_t *hn = bf16_ptr(h_new), *xp = bf16_ptr(x);
  const float *wa = norm_a ? w_a.data_ptr<float>() : nullptr, *wn = w_next.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t *hr = hp + r * h.stride(0), *ar = ap + r * a.stride(0);
      if (!norm_a) add_row(hr, ar, D, hn + r * D);
      else if (weight_after) {  // h + bf16(bf16(a * r) * w_a)
        norm_row_weight_after(ar, wa, inv_rms(ar, D, e), D, xp + r * D);
        add_row(hr, xp + r * D, D, hn + r * D);
      } else add_normed_row(hr, ar, wa, inv_rms(ar, D, e), D, hn + r * D);
      norm_any(weight_after, hn + r * D, wn, inv_rms(hn + r * D, D, e), D, xp + r * D);
    }
  });
  return {h_new, x};
}

// q/k norm and RoPE of a fused q|k|v projection, as the lean forward computes them in torch:
//   n = bf16(rms_norm(head) * w[head]) (norm_any);  y = bf16(bf16(n * cos) + bf16(rotate_half(n) * sin))
// qkv [T, (H + 2 KV) * D] bf16, w [H + KV, D] float32 or empty (no q/k norm: n = head),
// cos/sin [T, D] bf16 -> q [T, H, D], k [T, KV, D], v [T, KV, D] (contiguous bf16; v copied as is).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_bf16(const at::Tensor& qkv, const at::Tensor& w,
                                                                 const at::Tensor& cos, const at::Tensor& sin,
                                                                 int64_t H, int64_t KV, double eps, bool weight_after) {
  check_rows(qkv, "qk_norm_rope_bf16");
  const bool normed_heads = w.numel() > 0;
  const int64_t T = qkv.size(0), D = normed_heads ? w.size(-1) : cos.size(-1);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * KV) * D, "qk_norm_rope_bf16: qkv [T, (H + 2 KV) * D] with D ",
              "even expected, got ", qkv.sizes(), " for H=", H, " KV=", KV, " D=", D);
  if (normed_heads) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == H + KV, "qk_norm_rope_bf16: w [H + KV, D] expected, got ", w.sizes());
    check_weight(w, D, "qk_norm_rope_bf16");
  }
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == T * D,
                "qk_norm_rope_bf16: cos and sin contiguous bf16 [T, D] expected, got ", t->sizes());
  auto opts = qkv.options();
  at::Tensor q = at::empty({T, H, D}, opts), k = at::empty({T, KV, D}, opts);
  at::Tensor v = qkv.narrow(1, (H + KV) * D, KV * D).reshape({T, KV, D}).contiguous();
  const uint16_t *xp = bf16_ptr(qkv), *cp = bf16_ptr(cos), *sp = bf16_ptr(sin);
  uint16_t *qp = bf16_ptr(q), *kp = bf16_ptr(k);
  const float* wp = normed_heads ? w.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T * (H + KV), 16, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> normed(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / (H + KV), head = i % (H + KV);
      const uint16_t* row = xp + t * qkv.stride(0) + head * D;
      if (normed_heads) norm_any(weight_after, row, wp + head * D, inv_rms(row, D, e), D, normed.data());
      uint16_t* out = head < H ? qp + (t * H + head) * D : kp + (t * KV + head - H) * D;
      rope_row(normed_heads ? normed.data() : row, cp + t * D, sp + t * D, D, out);
    }
  });
  return {q, k, v};
}

namespace {

// A gated MLP activation row by row: gate_up [T, 2I] bf16 (gate | up) -> [T, I] bf16 by `row`.
at::Tensor gated_mul(const at::Tensor& gate_up, const char* what, void (*row)(const uint16_t*, int64_t, uint16_t*)) {
  check_rows(gate_up, what);
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, what, ": gate_up [T, 2 I] expected, got ", gate_up.sizes());
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const uint16_t* gp = bf16_ptr(gate_up);
  uint16_t* op = bf16_ptr(out);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) row(gp + t * gate_up.stride(0), I, op + t * I);
  });
  return out;
}

}  // namespace

// The MLP's activation: gate_up [T, 2I] bf16 (gate | up) -> bf16(bf16(gelu_tanh(gate)) * up) [T, I],
// torch's `gelu(gate, approximate="tanh") * up` on bf16 tensors.
at::Tensor gelu_tanh_mul_bf16(const at::Tensor& gate_up) { return gated_mul(gate_up, "gelu_tanh_mul_bf16", gelu_mul_row); }

// The SwiGLU activation: gate_up [T, 2I] bf16 (gate | up) -> bf16(bf16(silu(gate)) * up) [T, I],
// torch's `silu(gate) * up` on bf16 tensors (silu's exp by the polynomial: within a rounding step).
at::Tensor silu_mul_bf16(const at::Tensor& gate_up) { return gated_mul(gate_up, "silu_mul_bf16", silu_mul_row); }

// Attention probabilities of a prefill piece in one pass:
//   torch.softmax(scores.masked_fill(hidden, -inf), -1) for bf16 scores [B, R, N] (rows of B
//   heads over R queries), hidden [R, N] bool (True: the query may not see the entry) or empty.
// In float32 as torch's: the row's max, exp(x - max) (the polynomial above), their sum, each times
// 1 / sum, rounded to bf16; a row that sees nothing gets zeros (torch's NaN, which the caller
// zeroes). Written in place.
void masked_softmax_bf16_(at::Tensor& scores, const at::Tensor& hidden) {
  TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == at::kBFloat16 && scores.is_contiguous(),
              "masked_softmax_bf16_: contiguous bf16 scores [B, R, N] expected, got ", scores.sizes());
  const int64_t B = scores.size(0), R = scores.size(1), N = scores.size(2);
  const bool masked = hidden.numel() > 0;
  TORCH_CHECK(!masked || (hidden.scalar_type() == at::kBool && hidden.is_contiguous() && hidden.dim() == 2
                          && hidden.size(0) == R && hidden.size(1) == N),
              "masked_softmax_bf16_: hidden bool [R, N] or empty expected, got ", hidden.sizes());
  uint16_t* sp = bf16_ptr(scores);
  const uint8_t* hp = masked ? reinterpret_cast<const uint8_t*>(hidden.data_ptr<bool>()) : nullptr;
  at::parallel_for(0, B * R, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(N);
    for (int64_t i = begin; i < end; ++i)
      softmax_row(sp + i * N, masked ? hp + (i % R) * N : nullptr, N, row.data());
  });
}
