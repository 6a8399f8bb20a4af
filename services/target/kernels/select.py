"""Kernel selection: the one place that picks a target's kernels.

`get_kernels(backend, cpp_attention)` returns one `Kernels`: the verbs of the kernel protocol
(protocol.py: store, plan, attend, accept) of one backend. The model runner calls it once
(again only when its forward changes), and everything else uses what it returned: attention
(model/attention.py) calls `plan` and `attend` without asking which backend it has. The
backend string comes from the caller (the engine's config, which may take it from
SPECMESH_KERNELS); this module never reads the environment itself.

  "auto"      -> "triton" when torch.cuda.is_available(), else "cpu"
  "cpu"       -> the CPU attention that reads each sequence's blocks in place
                 (paged_attention_cpu.py), in C++ where the CPU allows and `cpp_attention`
                 asks for it; plain PyTorch for the rest
  "triton"    -> Triton kernels (needs CUDA, or TRITON_INTERPRET=1 set before the
                 first call, for CPU tests; tensors must then live on the CPU)
  "reference" -> plain PyTorch kernels (any device)

`cpp_attention`: the cpu backend's bf16 attention runs its decode rows, small trees and
(AVX512-BF16) prefill chunks in C++ (cpu_decode_attention.cpp, cpu_chunk_attention.cpp).
The runner asks for it exactly where the lean forward's C++ row ops run (same precision
class: both give up bit-exactness with transformers); the other backends ignore it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kv_store import store_kv_reference
from .paged_attention import paged_attention_planned, paged_attention_reference, plan_paged_attention
from .paged_attention_cpu import (paged_attention_cpu, paged_attention_cpu_planned, plan_cpu_attention, store_and_attend,
                                  whole_windows)
from .protocol import AcceptTreeGreedy, AcceptTreeSampling, Attend, PagedAttention, PlanAttention, StoreKV
from .tree_accept import accept_tree_greedy_reference, accept_tree_sampling_reference

from services.target.settings import KERNEL_BACKENDS as BACKENDS  # noqa: E402  (declared once, for the settings too)


@dataclass(frozen=True)
class Kernels:
    """The kernel protocol's verbs of one backend (signatures: protocol.py)."""

    backend: str  # "triton", "cpu" or "reference"
    store_kv: StoreKV
    plan: PlanAttention
    attend: Attend
    accept_tree_greedy: AcceptTreeGreedy
    accept_tree_sampling: AcceptTreeSampling
    paged_attention: PagedAttention  # plan + attend in one checked call
    cpp_attention: bool = False  # cpu backend: attention in C++ where the CPU allows
    # store_kv then attend in one call where the step's plan allows, else None (the caller takes
    # the two): (query, key, value, k_cache, v_cache, slot_mapping, plan, scale) -> out or None.
    store_and_attend: Callable | None = None


def get_kernels(backend: str = "auto", cpp_attention: bool = False) -> Kernels:
    """Return the kernels of `backend` ("auto", "triton", "cpu" or "reference")."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.cuda.is_available() else "cpu"
    if backend == "reference":
        return Kernels("reference", store_kv_reference, _plan_reference, paged_attention_planned,
                       accept_tree_greedy_reference, accept_tree_sampling_reference,
                       paged_attention_reference)
    if backend == "cpu":
        return Kernels("cpu", store_kv_reference, functools.partial(_plan_cpu, cpp_attention=cpp_attention),
                       functools.partial(paged_attention_cpu_planned, cpp_attention=cpp_attention),
                       accept_tree_greedy_reference, accept_tree_sampling_reference,
                       paged_attention_cpu, cpp_attention, store_and_attend if cpp_attention else None)
    return _triton_kernels()


def _plan_reference(query, k_cache, block_tables, context_lens, query_start_loc, query_positions,
                    sliding_window, tree_mask):
    """Index and mask tensors of the step (they depend on the step, not the layer)."""
    return plan_paged_attention(k_cache.shape[1], block_tables, context_lens, query_start_loc,
                                query_positions, sliding_window, tree_mask)


def _plan_cpu(query, k_cache, block_tables, context_lens, query_start_loc, query_positions,
              sliding_window, tree_mask, cpp_attention: bool):
    """Per-sequence block ranges; long window chunks cut in pieces unless they attend whole
    (paged_attention_cpu.whole_windows)."""
    whole = whole_windows(query.dtype, k_cache.dtype, query.shape[-1], cpp_attention)
    return plan_cpu_attention(k_cache.shape[1], block_tables, context_lens, query_start_loc,
                              query_positions, sliding_window, tree_mask, cut_windows=not whole)


@dataclass(frozen=True)
class _StepArgs:
    """The Triton kernel's plan: the step's metadata as it is (the kernel plans in its launch)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    query_positions: torch.Tensor  # [num_tokens] int32
    sliding_window: int | None
    tree_mask: torch.Tensor | None  # [num_tokens, max_q_len] bool


def _plan_triton(query, k_cache, block_tables, context_lens, query_start_loc, query_positions,
                 sliding_window, tree_mask) -> _StepArgs:
    return _StepArgs(block_tables, context_lens, query_start_loc, query_positions, sliding_window, tree_mask)


def _attend_with(paged_attention: PagedAttention):
    def attend(query, k_cache, v_cache, plan: _StepArgs, scale, k_scale=None, v_scale=None):
        return paged_attention(query, k_cache, v_cache, plan.block_tables, plan.context_lens,
                               plan.query_start_loc, plan.query_positions, scale,
                               sliding_window=plan.sliding_window, tree_mask=plan.tree_mask,
                               k_scale=k_scale, v_scale=v_scale)
    return attend


def _triton_kernels() -> Kernels:
    # Imported lazily: @triton.jit decides between compiled and interpreted kernels when
    # the module is imported, so TRITON_INTERPRET must be set before this first import.
    from triton import knobs

    if not torch.cuda.is_available() and not knobs.runtime.interpret:
        raise RuntimeError(
            "kernel backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for CPU "
            "tests); use 'reference' or 'auto' on this machine"
        )
    from .kv_store_triton import store_kv_triton
    from .paged_attention_triton import paged_attention_triton
    from .tree_accept_triton import (
        accept_tree_greedy_triton,
        accept_tree_sampling_triton,
    )

    return Kernels("triton", store_kv_triton, _plan_triton, _attend_with(paged_attention_triton),
                   accept_tree_greedy_triton, accept_tree_sampling_triton, paged_attention_triton)
