"""Kernel selection: one object with the kernel entry points of one backend.

The engine calls get_kernels() once and uses the returned Kernels everywhere, so the
choice is made in one place. The backend string comes from the caller (e.g. the
engine's config, which may take it from SPECMESH_KERNELS); this module never reads the
environment itself.

  "auto"      -> "triton" when torch.cuda.is_available(), else "cpu"
  "cpu"       -> plain PyTorch kernels with the CPU attention that reads each sequence's
                 blocks in place (paged_attention_cpu.py); same signatures as the reference
  "triton"    -> Triton kernels (needs CUDA, or TRITON_INTERPRET=1 set before the
                 first call, for CPU tests; tensors must then live on the CPU)
  "reference" -> plain PyTorch kernels (any device)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kv_store import store_kv_reference
from .paged_attention import paged_attention_reference
from .paged_attention_cpu import paged_attention_cpu
from .tree_accept import accept_tree_greedy_reference, accept_tree_sampling_reference

BACKENDS = ("auto", "triton", "cpu", "reference")


@dataclass(frozen=True)
class Kernels:
    """The kernel entry points of one backend (signatures: see each kernel module)."""

    backend: str  # "triton", "cpu" or "reference"
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    accept_tree_greedy: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    accept_tree_sampling: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def get_kernels(backend: str = "auto") -> Kernels:
    """Return the kernels of `backend` ("auto", "triton", "cpu" or "reference")."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.cuda.is_available() else "cpu"
    if backend in ("reference", "cpu"):
        return Kernels(
            backend=backend,
            store_kv=store_kv_reference,
            paged_attention=paged_attention_reference if backend == "reference" else paged_attention_cpu,
            accept_tree_greedy=accept_tree_greedy_reference,
            accept_tree_sampling=accept_tree_sampling_reference,
        )
    return _triton_kernels()


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

    return Kernels(
        backend="triton",
        store_kv=store_kv_triton,
        paged_attention=paged_attention_triton,
        accept_tree_greedy=accept_tree_greedy_triton,
        accept_tree_sampling=accept_tree_sampling_triton,
    )
