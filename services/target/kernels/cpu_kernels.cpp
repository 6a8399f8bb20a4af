// The Python bindings of specmesh's CPU kernel module (specmesh_cpu_kernels): bf16 linear layers,
// the lean forwards' per-row ops and the paged bf16 attention of decode rows and prefill chunks.
// Prototypes: cpu_kernels.h; built by cpu_kernels.py.

#include <torch/extension.h>

#include "cpu_kernels.h"

#include <cstdlib>
#include <cstring>
#include <utility>

namespace {

// Whether the kernels run without Python's GIL (SPECMESH_KERNELS_HOLD_GIL=1 keeps it, read once).
// A decode step spends most of its time in these calls; holding the GIL through them made every
// other Python thread of the process (the target's gRPC handlers sending each token, the draft
// client's reader) wait for the engine thread's switch interval and then run between its kernels,
// on its critical path. Their arguments are tensors and numbers, converted before the release,
// and nothing in them touches Python objects.
bool release_gil() {
  static const bool release = [] {
    const char* hold = std::getenv("SPECMESH_KERNELS_HOLD_GIL");
    return !(hold && std::strcmp(hold, "1") == 0);
  }();
  return release;
}

template <auto F>
struct WithoutGil;

template <typename R, typename... A, R (*F)(A...)>
struct WithoutGil<F> {
  static R call(A... args) {
    if (!release_gil()) return F(std::forward<A>(args)...);
    pybind11::gil_scoped_release released;
    return F(std::forward<A>(args)...);
  }
};

}  // namespace

#define SPECMESH_NOGIL(f) &WithoutGil<&f>::call

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16_weight", SPECMESH_NOGIL(pack_bf16_weight),
        "bf16 [N, K] -> [ceil(N/32), ceil(K/2), 64] panels for bf16_linear");
  m.def("bf16_linear", SPECMESH_NOGIL(bf16_linear),
        "y = x w^T for bf16 x [M, K] and packed w (float32 sums, bf16 out); dot: VDPBF16PS, else widen + FMA");
  m.def("few_row_panel_groups", &few_row_panel_groups,
        "bf16_linear's panels per group at 1-3 rows: P panels over `threads`, at most `widest` a group");
  m.def("bf16_linear_amx", SPECMESH_NOGIL(bf16_linear_amx),
        "y = x w^T over the same panels with AMX tiles (K a multiple of 32; float32 sums, bf16 out)");
  m.def("amx_ready", &amx_ready, "whether the OS granted this process the AMX tile registers (asked once)");
  m.def("gguf_linear", SPECMESH_NOGIL(gguf_linear),
        "y = x w^T for bf16 x [M, K] and GGUF block weights repacked as int8 quants, scales and offsets "
        "(VDPBF16PS; equal to bf16_linear over the weights dequantized to bf16)");
  m.def("gguf_rows", SPECMESH_NOGIL(gguf_rows), "rows ids of the weight gguf_linear multiplies, as the bf16 values it expands");
  m.def("argmax_screen", SPECMESH_NOGIL(argmax_screen),
        "int8 upper bounds of every logit and the best lower bound per row (VPDPBUSD, or AMX-INT8 tiles with amx), "
        "for rows that only need the argmax");
  m.def("argmax_rows_f32", SPECMESH_NOGIL(argmax_rows_f32), "first index of each float32 row's largest value, and whether the row is clean");
  m.def("rms_norm_bf16", SPECMESH_NOGIL(rms_norm_bf16), "RMSNorm of bf16 rows with float32 weight rows (Gemma's or, weight_after, Llama's rounding)");
  m.def("add_rms_norm_bf16", SPECMESH_NOGIL(add_rms_norm_bf16), "h + norm(a), then the next norm of it: (h_new, x)");
  m.def("qk_norm_rope_bf16", SPECMESH_NOGIL(qk_norm_rope_bf16), "q/k norm and RoPE of a fused qkv: (q, k, v)");
  m.def("gelu_tanh_mul_bf16", SPECMESH_NOGIL(gelu_tanh_mul_bf16), "gelu_tanh(gate) * up of a fused gate|up, bf16");
  m.def("silu_mul_bf16", SPECMESH_NOGIL(silu_mul_bf16), "silu(gate) * up of a fused gate|up, bf16");
  m.def("masked_softmax_bf16_", SPECMESH_NOGIL(masked_softmax_bf16_), "softmax of bf16 scores with a hidden mask, in place");
  m.def("decode_attention_bf16", SPECMESH_NOGIL(decode_attention_bf16), "decode rows' attention over the paged bf16 pool, in place");
  m.def("store_decode_attention_bf16", SPECMESH_NOGIL(store_decode_attention_bf16),
        "a layer's new keys and values into the pool, then its decode rows' attention");
  m.def("decode_layer_bf16", SPECMESH_NOGIL(decode_layer_bf16),
        "one decoder layer of decode rows: qkv, q/k norm + RoPE, store + attention, o, norms, MLP (h, x)");
  m.def("chunk_attention_bf16", SPECMESH_NOGIL(chunk_attention_bf16),
        "prefill chunks' attention over the paged bf16 pool (VDPBF16PS, or AMX tiles), each row one visible run, in place");
}
