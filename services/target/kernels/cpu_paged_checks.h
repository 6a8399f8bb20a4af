// Argument checks shared by the C++ attention entry points over the paged bf16 pool
// (cpu_decode_attention.cpp, cpu_chunk_attention.cpp): a wrong tensor fails with a message
// naming the function, before any read.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace specmesh_checks {

// query [T, H, D] and out like it; k_cache, v_cache [num_blocks, block_size, KV, D] of one shape;
// all contiguous bf16; D a multiple of head_multiple; H a multiple of KV.
inline void check_paged_bf16(const char* fn, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& out, int64_t head_multiple) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && query.is_contiguous(),
              fn, ": contiguous bf16 query [T, H, D] expected");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous()
                  && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kBFloat16 && v_cache.is_contiguous(),
              fn, ": contiguous bf16 caches [blocks, block_size, KV, D] of one shape expected");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
              fn, ": out must be like query");
  TORCH_CHECK(k_cache.size(3) == query.size(2) && query.size(2) % head_multiple == 0 && query.size(1) % k_cache.size(2) == 0,
              fn, ": head_dim a multiple of ", head_multiple,
              ", equal in query and cache, and heads a multiple of kv heads expected");
}

}  // namespace specmesh_checks
