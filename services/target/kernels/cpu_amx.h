// The AMX tile loop of cpu_amx_linear.cpp, for the module's other linear kernels (cpu_gguf_linear.cpp
// runs it over a panel it expanded to bf16). AVX-512 build only; callers check amx_ready() first.
#pragma once

#include <cstdint>

namespace specmesh_amx {

constexpr int64_t kTileRows = 16;  // rows of x per tile: callers pad x's rows to a multiple of this
constexpr int64_t kTileK = 32;     // k per tile step: K must be a multiple of this
constexpr int64_t kRowChunk = 256; // rows per pass over a thread's panels (their x stays in L2)

void begin();  // loads this thread's tile configuration (before panel_rows)
void end();    // releases this thread's tiles

// Rows [0, M_pad) of x (bf16, row stride ldx elements, M_pad a multiple of 16) against one packed
// panel ([K2, 64] bf16, cpu_panels.h; 2 * K2 a multiple of 32) -> buf [M_pad, 32] float32 sums.
void panel_rows(const uint16_t* x, int64_t ldx, int64_t M_pad, const uint16_t* panel, int64_t K2, float* buf);

}  // namespace specmesh_amx
