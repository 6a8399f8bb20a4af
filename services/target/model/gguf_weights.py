"""`--weights gguf`: the linear layers of a model prepared from a GGUF file multiply the file's own
blocks (kernels/cpu_gguf_linear.py), not the bf16 weights the preparation dequantized from them.

The prepared directory keeps its source GGUF (services/common/models/prepare.py, `source_gguf`).
Each linear layer of the loaded model is matched to its GGUF tensors by name (the names the
preparation mapped: `prepare.hf_name`), the fused projections (gemma3_forward.fuse_projections) to
their parts in order, and a tied lm_head to the token embedding. Before a layer is replaced, the
blocks' bf16 values are checked equal to the layer's loaded weight on a few rows, so a GGUF that
is not the directory's source is refused instead of served. The outputs then equal
`--weights bf16-avx512` bit for bit (tests/target/test_gguf_weights.py).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from services.target.kernels import cpu_gguf_linear, cpu_linear, huge_pages
from services.target.model.fused_name import FUSED
from services.target.model.gguf_tensors import read_tensors

log = logging.getLogger(__name__)

_CHECK_ROWS = 4  # rows of each part compared with the loaded weight: first and last, two between


class GGUFLinear(nn.Module):
    """y = x W^T with W the GGUF blocks of one (or a fused run of) weight(s) [out, in], no bias.

    `panels` (weights="gguf-bf16"): the same weights as bf16_linear's panels, which calls of more
    than `block_rows` rows multiply instead. Those calls are compute-bound, and expanding the blocks
    there cost the default model's 18-request batch ~15% against bf16-avx512; at 1-3 rows the
    blocks' fewer bytes win where memory bounds a decode step (`choose_decode_path` checks that on
    the running machine). The outputs are the same either way: gguf_linear equals bf16_linear over
    the blocks' bf16 values bit for bit, and the panels are packed from exactly those values."""

    DECODE_ROWS = 3  # gguf_linear's register tiles (cpu_gguf_linear.cpp); more rows expand panels

    def __init__(self, packed: cpu_gguf_linear.Packed, out_dtype: torch.dtype | None = None,
                 with_bf16: bool = False) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.out_dtype = out_dtype
        self.panels = (huge_pages.place(cpu_linear.pack(cpu_gguf_linear.rows(packed, torch.arange(packed.out_features))))
                       if with_bf16 else None)  # [ceil(out / 32), in / 2, 64] bf16
        self.block_rows = self.DECODE_ROWS  # with panels: calls of up to this many rows multiply the blocks

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] bf16 -> [rows, out] bf16
        if self.panels is not None and x.shape[0] > self.block_rows:
            return cpu_linear.bf16_linear(x, self.panels, self.out_features)
        return cpu_gguf_linear.gguf_linear(x, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [rows, in] bf16
        y = self._matmul(flat)  # [rows, out] bf16
        return y.to(self.out_dtype or x.dtype).reshape(*x.shape[:-1], self.out_features)

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for x [M, in] bf16 (a lean forward's activations), without nn.Module's call."""
        if self.out_dtype not in (None, torch.bfloat16) or x.dtype != torch.bfloat16:
            return self.forward(x)
        return self._matmul(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of W as bf16 [T, in]: a tied embedding's lookup in the same blocks."""
        return cpu_gguf_linear.rows(self.packed, ids)


def _sources(name: str, model: nn.Module, lm_head: nn.Module | None, module: nn.Module) -> list[str]:
    """The Hugging Face weight names a linear layer of the (fused) model holds, in output order."""
    if module is lm_head:
        tied = getattr(model.config, "tie_word_embeddings", False)
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    if name.startswith(FUSED + "."):
        kind, _, layer = name[len(FUSED) + 1:].rpartition("_")
        parts = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "gate_up": ("mlp", ("gate_proj", "up_proj"))}
        owner, names = parts[kind]
        return [f"model.layers.{layer}.{owner}.{n}.weight" for n in names]
    return [f"{name}.weight"]


def _check_rows(parts: cpu_gguf_linear.Decoded, weight: torch.Tensor, what: str) -> None:
    n = parts.q.shape[0]
    rows = sorted({0, n // 3, 2 * n // 3, n - 1})[:_CHECK_ROWS]
    sample = cpu_gguf_linear.Decoded(parts.q[rows], parts.scales[rows],
                                     None if parts.offsets is None else parts.offsets[rows], parts.sub_block)
    if tuple(weight.shape) != parts.q.shape or not torch.equal(cpu_gguf_linear.dequantize_bf16(sample),
                                                               weight[rows].to(torch.bfloat16)):
        raise ValueError(f"the GGUF's blocks of {what} are not the loaded model's weights: the directory's "
                         "GGUF is not its source; prepare the model again (`specmesh models prepare --force`)")


def pack_gguf_linears(model: nn.Module, gguf_path: Path, with_bf16: bool = False) -> int:
    """Replaces each nn.Linear of `model` (fused already, not sharded) by a GGUFLinear over the
    blocks of `gguf_path` (with bf16 panels of them for calls of many rows: `with_bf16`); returns
    how many. The lm_head keeps float32 outputs."""
    from services.common.models.prepare import hf_name

    if not cpu_gguf_linear.available():
        raise ValueError(f"weights='gguf' cannot run here: {cpu_gguf_linear.unavailable_reason()}")
    tensors = {hf_name(t.name): t for t in read_tensors(gguf_path).values()}  # the index alone: fast
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    total, layers = 0, []  # layers: the replaced layers but the output layer
    for name, module in targets:
        if module.bias is not None:
            raise ValueError(f"weights='gguf': {name} has a bias, which the GGUF kernel does not add")
        parts, offset = [], 0
        for source in _sources(name, model, lm_head, module):
            if source not in tensors:
                raise ValueError(f"weights='gguf': {gguf_path.name} has no tensor for {source} ({name})")
            tensor = tensors[source]
            decoded = cpu_gguf_linear.decode_blocks(np.asarray(tensor.data), tensor.tensor_type.name)
            _check_rows(decoded, module.weight.detach()[offset:offset + decoded.q.shape[0]], source)
            offset += decoded.q.shape[0]
            parts.append(decoded)
        if offset != module.out_features:
            raise ValueError(f"weights='gguf': {name}'s GGUF parts have {offset} rows, the layer {module.out_features}")
        packed = cpu_gguf_linear.pack(parts[0] if len(parts) == 1 else cpu_gguf_linear.concat(parts))
        total += packed.nbytes()
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = GGUFLinear(packed, torch.float32 if module is lm_head else None, with_bf16)
        if module is not lm_head:
            layers.append(layer)
        total += 0 if layer.panels is None else layer.panels.numel() * layer.panels.element_size()
        setattr(parent, attr, layer)
    log.info("GGUF weights: %d linear layers from %s, %.0f MB in the kernels' layouts%s", len(targets), gguf_path.name,
             total / 1e6, " (with bf16 panels for calls of many rows)" if with_bf16 else "")
    if with_bf16 and layers:  # the output layer keeps its blocks for decode rows: read from memory, its bytes decide
        blocks, panels = choose_decode_path(layers)
        log.info("gguf-bf16: decode rows multiply the %s (a one-row pass over %d layers: %.2f ms on the blocks, "
                 "%.2f ms on the panels)", "blocks" if blocks <= panels else "bf16 panels", len(layers),
                 blocks * 1e3, panels * 1e3)
    return len(targets)


def choose_decode_path(layers: list[GGUFLinear], rounds: int = 7) -> tuple[float, float]:
    """Where gguf-bf16 layers multiply decode rows on this machine: the blocks (fewer bytes, an
    expansion in registers) or the panels (twice the bytes, none), whichever one-row pass over all
    `layers` is faster, the two taking turns `rounds` times (a CPU whose cache holds the bf16 layers
    can favour the panels: on a 2-core Xeon with a 260 MB L3 one layer call hot in L3 took 0.04-0.13
    ms on the blocks against 0.02-0.09 on bf16, docs/kernels.md). Either gives the same bits. Sets
    every layer's `block_rows`; returns the median seconds of a pass on the blocks and on the panels."""
    inputs = {n: torch.randn(1, n).to(torch.bfloat16) for n in {layer.in_features for layer in layers}}

    def one_pass(block_rows: int) -> float:
        for layer in layers:
            layer.block_rows = block_rows
        start = time.perf_counter()
        for layer in layers:
            layer.matmul_rows(inputs[layer.in_features])
        return time.perf_counter() - start
    times: dict[int, list[float]] = {GGUFLinear.DECODE_ROWS: [], 0: []}
    for _ in range(rounds):
        for block_rows, seconds in times.items():
            seconds.append(one_pass(block_rows))
    blocks, panels = statistics.median(times[GGUFLinear.DECODE_ROWS]), statistics.median(times[0])
    for layer in layers:
        layer.block_rows = GGUFLinear.DECODE_ROWS if blocks <= panels else 0
    return blocks, panels


def tied_embedding_rows(model: nn.Module):
    """The lookup of a tied embedding in the lm_head's GGUF blocks (ids [T] -> [T, hidden] bf16), or None."""
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(lm_head, GGUFLinear) and getattr(model.config, "tie_word_embeddings", False):
        return lm_head.rows
    return None
