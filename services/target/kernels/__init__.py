"""Target-engine kernels: paged attention, KV store (optionally FP8), tree acceptance.

Each kernel has a PyTorch reference (`*_reference`, importable here, no Triton needed),
a Triton version with the same signature (`*_triton` in the `*_triton` modules, imported
lazily) and, for attention on the CPU, a version that reads blocks in place (C++ where the
CPU allows). The verbs and their signatures: protocol.py; the engine obtains one backend's
through `get_kernels(backend)` (select.py), once.
"""

from .kv_store import store_kv_reference
from .paged_attention import paged_attention_reference
from .select import BACKENDS, Kernels, get_kernels
from .tree_accept import accept_tree_greedy_reference, accept_tree_sampling_reference

__all__ = [
    "BACKENDS",
    "Kernels",
    "get_kernels",
    "store_kv_reference",
    "paged_attention_reference",
    "accept_tree_greedy_reference",
    "accept_tree_sampling_reference",
]
