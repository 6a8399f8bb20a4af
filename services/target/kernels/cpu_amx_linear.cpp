// bf16 linear layers on CPUs with AMX (Intel Sapphire Rapids and later): y[M, N] = x[M, K] @ w[N, K]^T
// over the same packed panels as cpu_linear.cpp, for calls of many rows (prefill chunks, big batches).
//
// Why: on such a CPU one TDPBF16PS multiplies a 16 x 32 tile of x by a 32 x 16 tile of w, 16 times the
// work of a VDPBF16PS; oneDNN's AMX path ran a 512-row chunk of the default model's linears 5-11x
// faster than the VDPBF16PS loop, and 18 rows 1.7-3.8x (benchmarks/linear_formats.py; docs/kernels.md).
// Reading the panels the VDPBF16PS loop reads keeps one copy of the weights.
//
// The panels are already AMX's layout for the weight operand: [p, kk] holds columns 0-15 of panel p
// as (k = 2kk, 2kk + 1) pairs in slots 0-31 and columns 16-31 in slots 32-63, so 16 consecutive kk
// of one half, 128 bytes apart, are one 16-row B tile (16 k pairs x 16 columns).
// Precision: bf16 products, float32 sums, one rounding to bf16, as the VDPBF16PS loop; but inside a
// tile step (16 k pairs) the hardware adds in its own way, which matches neither pair order of a
// sequential float32 sum, so an output differs from the loop's by one bf16 step in ~1 of 10,000
// (tests/target/test_cpu_amx_linear.py). Each row's outputs depend on that row alone.
//
// Linux gives a process the tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM);
// `amx_ready` asks once and says whether it was granted.

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

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(SPECMESH_ISA_AVX512)

#define SPECMESH_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,amx-tile,amx-bf16")))

namespace {

using specmesh_panels::kPairSlots;
using specmesh_panels::kPanel;

using specmesh_amx::kRowChunk;
using specmesh_amx::kTileK;
using specmesh_amx::kTileRows;

// The tile palette: tmm0-3 the float32 sums of a 32 x 32 block (row tile r, column half h at 2r + h),
// tmm4-5 two row tiles of x, tmm6-7 the panel's two column halves.
// Every tile is 16 rows of 64 bytes: 16 float32 sums, 32 bf16 of x, or 16 bf16 pairs of w.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows};
};
// A constant in memory: GCC drops stores to a local config as dead (it does not see LDTILECFG read them).
constexpr TileConfig kTileConfig{};

}  // namespace

namespace specmesh_amx {

SPECMESH_AMX_TARGET void begin() { _tile_loadconfig(&kTileConfig); }

SPECMESH_AMX_TARGET void end() { _tile_release(); }

namespace {

// Row tiles [0, RT) of x (bf16, row stride ldx elements, K2 pairs a row) against one panel: float32
// sums into buf (32 floats a row, row stride 32).
template <int RT>
SPECMESH_AMX_TARGET void block(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K2, float* buf) {
  _tile_zero(0);
  _tile_zero(1);
  if (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * 2, w_stride = kPairSlots * 2;  // bytes
  for (int64_t kk = 0; kk < K2; kk += kTileK / 2) {
    _tile_loadd(6, panel + kk * kPairSlots, w_stride);
    _tile_loadd(7, panel + kk * kPairSlots + 32, w_stride);
    _tile_loadd(4, x + 2 * kk, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RT == 2) {
      _tile_loadd(5, x + kTileRows * ldx + 2 * kk, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, buf, kPanel * 4);
  _tile_stored(1, buf + 16, kPanel * 4);
  if (RT == 2) {
    _tile_stored(2, buf + kTileRows * kPanel, kPanel * 4);
    _tile_stored(3, buf + kTileRows * kPanel + 16, kPanel * 4);
  }
}

}  // namespace

SPECMESH_AMX_TARGET void panel_rows(const uint16_t* x, int64_t ldx, int64_t M_pad, const uint16_t* panel, int64_t K2,
                                    float* buf) {
  int64_t m = 0;
  for (; m + 2 * kTileRows <= M_pad; m += 2 * kTileRows) block<2>(x + m * ldx, ldx, panel, K2, buf + m * kPanel);
  if (m < M_pad) block<1>(x + m * ldx, ldx, panel, K2, buf + m * kPanel);
}

}  // namespace specmesh_amx

namespace {

// Panels [begin, end) for every row (one thread's share).
void thread_panels(const uint16_t* x, int64_t M_pad, int64_t M, int64_t K2, const uint16_t* wp, int64_t begin,
                   int64_t end, int64_t N, uint16_t* y) {
  specmesh_amx::begin();
  std::vector<float> buf(std::min(kRowChunk, M_pad) * kPanel);  // [rows, 32] float32 sums of one panel
  for (int64_t m0 = 0; m0 < M_pad; m0 += kRowChunk) {
    const int64_t rows_pad = std::min(kRowChunk, M_pad - m0), rows = std::min(rows_pad, M - m0);
    for (int64_t p = begin; p < end; ++p) {
      specmesh_amx::panel_rows(x + m0 * 2 * K2, 2 * K2, rows_pad, wp + p * K2 * kPairSlots, K2, buf.data());
      specmesh_panels::write_panel(buf.data(), rows, p, N, y + m0 * N);
    }
  }
  specmesh_amx::end();
}

}  // namespace

bool amx_ready() {
#if defined(__linux__)
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, the AMX tile data
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// x: [M, K] bf16 with K a multiple of 32, packed: pack_bf16_weight of a [N, K] weight -> [M, N] bf16.
// The caller checks the CPU has AMX and amx_ready().
at::Tensor bf16_linear_amx(const at::Tensor& x_in, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && packed.dim() == 3 && x_in.size(1) % kTileK == 0 && packed.size(2) == kPairSlots
                  && packed.size(1) == x_in.size(1) / 2 && packed.size(0) == (N + kPanel - 1) / kPanel,
              "bf16_linear_amx: x [M, K] and panels [ceil(N/32), K/2, 64] expected with K a multiple of 32, got ",
              x_in.sizes(), " and ", packed.sizes(), " for N=", N);
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear_amx: bf16 tensors expected");
  TORCH_CHECK(packed.is_contiguous(), "bf16_linear_amx: the panels must be contiguous");
  TORCH_CHECK(amx_ready(), "bf16_linear_amx: the OS did not grant this process the AMX tile registers");
  const int64_t M = x_in.size(0), K = x_in.size(1), P = packed.size(0), K2 = K / 2;
  at::Tensor out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  // [M_pad, K]: the rows padded with zeros to whole tiles (their sums are computed and dropped).
  const int64_t M_pad = (M + kTileRows - 1) / kTileRows * kTileRows;
  at::Tensor x = x_in.contiguous();
  if (M_pad != M) x = at::constant_pad_nd(x, {0, 0, 0, M_pad - M});
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 4, [&](int64_t begin, int64_t end) { thread_panels(xp, M_pad, M, K2, wp, begin, end, N, yp); });
  return out;
}

#else  // SPECMESH_ISA_AVX2: no AMX on such CPUs

bool amx_ready() { return false; }

at::Tensor bf16_linear_amx(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "bf16_linear_amx: this is the AVX2 build of the module (no AMX)");
}

#endif
