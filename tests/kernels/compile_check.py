"""Compile every Triton kernel variant for an NVIDIA target without a GPU.

Run as a script (TRITON_INTERPRET must be unset):
`python -m tests.kernels.compile_check [--quick] [ARCH]` (ARCH 90 by default).
Triton's full NVIDIA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled
ptxas) runs on the CPU, so this catches code the interpreter accepts but the compiler
rejects (types of loop-carried values, dot shapes, fp8 casts). --quick compiles a
subset (every flag at least once, ~20 s cold); the full matrix takes ~2 minutes cold
(Triton caches compiled kernels, so reruns are fast). Exits non-zero on a failure.
"""

from __future__ import annotations

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from services.target.kernels import kv_store_triton as kvs
from services.target.kernels import paged_attention_triton as pat
from services.target.kernels import tree_accept_triton as tat


def _attention_variants():
    ptrs = ["out_ptr", "query_ptr", "k_cache_ptr", "v_cache_ptr", "k_scale_ptr", "v_scale_ptr",
            "block_tables_ptr", "context_lens_ptr", "query_start_loc_ptr", "query_positions_ptr", "tree_mask_ptr"]
    shapes = [(4, 1, 256), (32, 8, 128), (8, 8, 64)]  # (heads, kv heads, head_dim)
    for (h, nkv, hd), (dtype, cache_dtype), fp8, tree, sw, decode in itertools.product(
        shapes, [("bf16", "bf16"), ("fp32", "fp32"), ("fp32", "bf16")], [False, True], [False, True], [False, True], [False, True]
    ):
        if (fp8 or cache_dtype != dtype) and (tree or decode or sw):
            continue  # the kv dtype is orthogonal to the mask logic; keep the matrix small
        if fp8 and cache_dtype != dtype:
            continue
        cache = "fp8e4nv" if fp8 else cache_dtype
        types = dict.fromkeys(ptrs, f"*{dtype}")
        types.update({"k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
                      "k_scale_ptr": "*fp32" if fp8 else f"*{dtype}", "v_scale_ptr": "*fp32" if fp8 else f"*{dtype}",
                      "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                      "query_positions_ptr": "*i32", "tree_mask_ptr": "*u8" if tree else f"*{dtype}",
                      "scale_log2": "fp32", "sliding_window": "i32", "num_seqs": "i32",
                      "max_blocks_per_seq": "i32", "max_q_len": "i32"})
        num_tokens, num_seqs = (8, 8) if decode else (64, 4)
        cfg = pat._launch_config(num_tokens, num_seqs, h // nkv, hd)
        num_warps = cfg.pop("num_warps")
        consts = dict(NUM_HEADS=h, NUM_KV_HEADS=nkv, HEAD_DIM=hd, HEAD_DIM_PAD=max(16, triton.next_power_of_2(hd)),
                      BLOCK_SIZE=16, QUERIES_PER_KV=h // nkv, USE_TREE_MASK=tree, USE_SLIDING_WINDOW=sw,
                      USE_FP8=fp8, UPCAST_DOT=False, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", **cfg)
        name = f"paged_attention h={h} kv={nkv} d={hd} {dtype} fp8={fp8} tree={tree} sw={sw} decode={decode}"
        name += "" if fp8 or cache == dtype else f" cache={cache}"
        yield name, pat._paged_attention_kernel, types, consts, num_warps
        if dtype == "bf16" and not decode:  # the interpreter's variant (see paged_attention_triton)
            yield name + " upcast", pat._paged_attention_kernel, types, \
                dict(consts, UPCAST_DOT=True, DOT_PRECISION="ieee"), num_warps


def _store_variants():
    for dtype, fp8, (nkv, hd) in itertools.product(["bf16", "fp32", "fp16"], [False, True], [(1, 256), (8, 128), (3, 48)]):
        yield from _store_variant(dtype, "fp8e4nv" if fp8 else dtype, nkv, hd)
    yield from _store_variant("fp32", "bf16", 2, 64)  # cast on store (ROUND_TO_BF16)
    yield from _store_variant("bf16", "fp32", 2, 64)


def _store_variant(dtype, cache, nkv, hd):
    fp8 = cache == "fp8e4nv"
    types = {"key_ptr": f"*{dtype}", "value_ptr": f"*{dtype}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
             "k_scale_ptr": "*fp32" if fp8 else f"*{cache}", "v_scale_ptr": "*fp32" if fp8 else f"*{cache}",
             "slot_mapping_ptr": "*i64"}
    consts = dict(NUM_KV_HEADS=nkv, HEAD_DIM=hd, HEADS_PAD=triton.next_power_of_2(nkv),
                  HEAD_DIM_PAD=triton.next_power_of_2(hd), USE_FP8=fp8,
                  ROUND_TO_BF16=cache == "bf16" and dtype != "bf16", FP8_MAX=448.0, FP8_MIN_AMAX=1e-12)
    name = f"store_kv {dtype} fp8={fp8} kv={nkv} d={hd}" + ("" if fp8 or cache == dtype else f" cache={cache}")
    yield name, kvs._store_kv_kernel, types, consts, 4


def _accept_variants():
    for par_t, nodes in itertools.product(["i32", "i64"], [1, 6, 33]):
        pad = triton.next_power_of_2(nodes)
        base = {"acc_ptr": "*i64", "nacc_ptr": "*i64", "bonus_ptr": "*i64"}
        greedy = dict(base, draft_tokens_ptr="*i64", parents_ptr=f"*{par_t}", num_nodes_ptr=f"*{par_t}",
                      target_argmax_ptr="*i64")
        yield f"accept_greedy parents={par_t} nodes={nodes}", tat._accept_greedy_kernel, greedy, \
            dict(MAX_NODES=nodes, NODES_PAD=pad), 4
        sampling = dict(base, residual_ptr="*fp64", draft_tokens_ptr="*i64", parents_ptr=f"*{par_t}",
                        num_nodes_ptr=f"*{par_t}", target_probs_ptr="*fp32", draft_probs_ptr="*fp32",
                        uniforms_ptr="*fp32", vocab="i32")
        yield f"accept_sampling parents={par_t} nodes={nodes}", tat._accept_sampling_kernel, sampling, \
            dict(MAX_NODES=nodes, NODES_PAD=pad, BLOCK_V=1024), 4


# Quick subset: names as produced above, chosen so every constexpr flag is compiled.
QUICK = {
    "store_kv bf16 fp8=True kv=1 d=256", "store_kv fp32 fp8=False kv=3 d=48", "store_kv fp16 fp8=True kv=8 d=128",
    "store_kv fp32 fp8=False kv=2 d=64 cache=bf16", "paged_attention h=32 kv=8 d=128 fp32 fp8=False tree=False sw=False decode=False cache=bf16",
    "paged_attention h=4 kv=1 d=256 bf16 fp8=False tree=False sw=False decode=False",
    "paged_attention h=4 kv=1 d=256 bf16 fp8=False tree=True sw=True decode=False",
    "paged_attention h=4 kv=1 d=256 bf16 fp8=False tree=False sw=True decode=True",
    "paged_attention h=4 kv=1 d=256 bf16 fp8=True tree=False sw=False decode=False",
    "paged_attention h=4 kv=1 d=256 bf16 fp8=False tree=True sw=True decode=False upcast",
    "paged_attention h=32 kv=8 d=128 bf16 fp8=False tree=False sw=False decode=True",
    "paged_attention h=32 kv=8 d=128 fp32 fp8=False tree=True sw=False decode=False",
    "paged_attention h=8 kv=8 d=64 fp32 fp8=True tree=False sw=False decode=False",
    "accept_greedy parents=i32 nodes=6", "accept_sampling parents=i32 nodes=6",
    "accept_greedy parents=i64 nodes=33", "accept_sampling parents=i64 nodes=33",
}


def main(arch: int = 90, quick: bool = False) -> int:
    target = GPUTarget("cuda", arch, 32)
    count = 0
    done = set()
    for name, fn, types, consts, num_warps in itertools.chain(_store_variants(), _attention_variants(), _accept_variants()):
        if quick and name not in QUICK:
            continue
        done.add(name)
        signature = {**types, **dict.fromkeys(consts, "constexpr")}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        try:
            triton.compile(src, target=target, options={"num_warps": num_warps})
        except Exception as exc:  # report which variant failed, then fail
            print(f"FAIL sm_{arch} {name}: {type(exc).__name__}: {exc}")
            return 1
        count += 1
    if quick and done != QUICK:
        print(f"FAIL: unknown quick variants {sorted(QUICK - done)}")
        return 1
    print(f"compiled {count} kernel variants for sm_{arch}")
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    sys.exit(main(int(args[0]) if args else 90, quick="--quick" in sys.argv[1:]))
