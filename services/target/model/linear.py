"""Prepacked linear layers for CPU serving: how the target's weights are stored and multiplied.

Without native bf16 (AVX2), torch's bf16 `F.linear` converts in a slow path, so bf16 weights
are the wrong format to multiply there, although they are the right format to store; with
native bf16 they are right for both (`bf16` below). The measurements behind each format's
place: docs/kernels.md.

  weights="auto"  bf16 models on an AVX-512 or AVX2 CPU where specmesh's kernel builds: `bf16-avx512`;
                  else, with bf16 dot products in hardware (oneDNN): `bf16`; other bf16/fp16
                  models on the CPU: `fp16`; else `none`.
  weights="none"  the model's own nn.Linear (float32 models always use it: MKL sgemm is
                  already at the FMA peak, and HF-exactness tests run in float32).
  weights="bf16"  each weight reordered once into oneDNN's blocked bf16 layout and multiplied by
                  oneDNN (bf16 products, float32 accumulation, bf16 outputs): bit-identical to
                  torch's own bf16 `F.linear`, so a bf16 model's logits are Hugging Face's; and on
                  an AVX512-BF16 CPU faster than fbgemm fp16 on the 262k-row lm_head at one token.
  weights="bf16-avx512"  specmesh's kernel (kernels/cpu_linear.cpp; the name predates its AVX2 build,
                  which AVX2 + FMA CPUs get under the same name: docs/kernels.md): bf16 weights packed once in
                  panels of 32 columns and pairs of k, multiplied with VDPBF16PS where the CPU has
                  AVX512-BF16, else widened to float32 and summed in k order with FMA; float32
                  sums, one rounding to bf16. The same products and precision as torch's bf16
                  linear, in another summation order: an output may differ by one bf16 rounding
                  step, and a row's outputs never depend on the other rows of the step (on a CPU with
                  AMX, calls of 3+ rows multiply the same panels with AMX tiles: a row's outputs then
                  depend on whether its call had 1-2 rows or more, by one bf16 step in ~1 of 10,000). Faster
                  than oneDNN at few rows (much faster where oneDNN emulates bf16), as fast at
                  many (benchmarks/linear_formats.py).
  weights="gguf"  the blocks of the GGUF file the model was prepared from (the default model's
                  Q8_0 / Q5_0 / Q4_K / Q6_K), multiplied by specmesh's AVX512-BF16 kernel
                  (kernels/cpu_gguf_linear.cpp) with outputs equal to bf16-avx512's bit for bit, reading
                  ~1.1 bytes a weight instead of 2 (model/gguf_weights.py). Where the CPU lacks
                  AVX512-BF16 it falls back to bf16-avx512 (same outputs on an AVX512-BF16 CPU), saying so.
  weights="gguf-bf16"  the GGUF blocks for calls of 1-3 rows (decode: memory-bound, where the blocks'
                  bytes win) and bf16-avx512's panels of the same values for more rows (batches,
                  verify trees, prefill: compute-bound, where expanding the blocks costs): the same
                  outputs as both, bit for bit, and the memory of both (model/gguf_weights.py).
  weights="fp16"  each weight converted once to fp16 and packed for fbgemm; activations go in
                  as float32 and products accumulate in float32. bf16 values are exact in fp16
                  except the 0.02% of Gemma 3 270M weights below fp16's normal range (< 6.1e-5),
                  which become fp16 subnormals (error < 3e-8 absolute each).
  weights="int8"  int8 weights with one scale per output channel (symmetric, amax / 127) through
                  fbgemm's dynamic-quantized linear: the activations are also quantized per call
                  (uint8, one scale per row: `Int8Linear`), so this trades accuracy for half the bytes; the
                  accuracy is measured in tests/target/test_quantization.py and README (torch's
                  weight-only int8 kernels are slower than fp16 fbgemm here, so they do not pay).
The lm_head keeps float32 outputs (no bf16 rounding of the logits before sampling).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from services.target.kernels import cpu_gguf_linear, cpu_linear, huge_pages

from services.target.settings import GGUF_FORMATS, WEIGHT_FORMATS  # noqa: E402,F401  (declared once, for the settings too)

log = logging.getLogger(__name__)


class PackedLinearFP16(nn.Module):
    """y = x W^T + b with W stored as fbgemm-packed fp16 (accumulation in float32)."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out_features, in_features]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = out_dtype
        with warnings.catch_warnings():  # deprecated in name only; no replacement for the CPU
            warnings.simplefilter("ignore")
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias, persistent=False)  # [out_features] f32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features).float()  # [rows, in] f32
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = torch.fbgemm_linear_fp16_weight(flat, self.packed, self.bias)  # [rows, out] f32
        return y.to(self.out_dtype or x.dtype).reshape(*x.shape[:-1], self.out_features)


class PackedLinearBF16(nn.Module):
    """y = x W^T + b with W stored in oneDNN's blocked bf16 layout (needs native bf16)."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().to(torch.bfloat16)  # [out_features, in_features]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = out_dtype
        # The batch-size hint only tunes the layout; 1 (decode) measured best at every row count.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)  # [out_features] bf16 or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [rows, in] bf16
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")  # [rows, out]
        return y.to(self.out_dtype or x.dtype).reshape(*x.shape[:-1], self.out_features)


class AVX512LinearBF16(nn.Module):
    """y = x W^T with bf16 W through specmesh's kernel (services/target/kernels/cpu_linear.cpp; AVX-512 or AVX2).

    bf16 products, float32 sums and one rounding to bf16, as torch's bf16 linear, but in the
    kernel's summation order (k in order with FMA; pairs of k with VDPBF16PS on AVX512-BF16), so an
    output can differ from torch's by one bf16 rounding step (tests/target/test_cpu_linear.py), and a
    row's outputs do not depend on the other rows of the step (where AMX tiles take calls of 3+ rows,
    only on whether the call had 1-2 rows or more: cpu_linear.AMX_MIN_ROWS).

    A bias (Qwen2's q/k/v) rides in the product as one more input column: W' = [W | b] and
    x' = [x | 1], so it is summed in float32 with the products before the one rounding, as
    torch adds it (a bf16 bias times 1 is exact), at the cost of copying the rows once. Zero
    columns after it keep K a multiple of 32, which the AMX tiles need (0 * 0 adds nothing).
    """

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = out_dtype
        weight = linear.weight.detach().to(torch.bfloat16)  # [out_features, in_features]
        self.has_bias = linear.bias is not None
        self.extended = self.in_features
        if self.has_bias:
            self.extended = (self.in_features + 1 + 31) // 32 * 32  # in', with the bias's column
            weight = torch.cat([weight, linear.bias.detach().to(torch.bfloat16)[:, None],
                                weight.new_zeros(self.out_features, self.extended - self.in_features - 1)],
                               dim=1)  # [out, in']
        self.register_buffer("panels", huge_pages.place(cpu_linear.pack(weight)), persistent=False)  # [ceil(out / 32), ceil(in' / 2), 64] bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [rows, in] bf16
        if self.has_bias:
            ext = flat.new_zeros(flat.shape[0], self.extended)  # [rows, in']
            ext[:, :self.in_features] = flat
            ext[:, self.in_features] = 1.0  # the bias's column
            flat = ext
        y = cpu_linear.bf16_linear(flat, self.panels, self.out_features)  # [rows, out] bf16
        return y.to(self.out_dtype or x.dtype).reshape(*x.shape[:-1], self.out_features)

    def matmul_rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for x [M, in] bf16 (a lean forward's activations) -> [M, out], without nn.Module's
        call and the reshapes: ~12 us a call less, 72 calls a decode step (`direct_rows`)."""
        if self.has_bias or self.out_dtype not in (None, torch.bfloat16) or x.dtype != torch.bfloat16:
            return self.forward(x)
        return cpu_linear.bf16_linear(x, self.panels, self.out_features)


def direct_rows(module: nn.Module):
    """The callable a lean forward multiplies 2-D activations [M, in] with: the layer's `matmul_rows`
    where it has one (specmesh's kernels), else the module itself."""
    return getattr(module, "matmul_rows", module)


def native_bf16_cpu() -> bool:
    """Whether oneDNN multiplies bf16 natively here (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Int8Linear(nn.Module):
    """int8 weights, one float scale per output channel, through fbgemm's dynamic linear.

    fbgemm quantizes a call's activations with one scale for all its rows, so one row of outsized
    activations (Gemma's first token carries activations hundreds of times the others') would leave
    every other row of a prefill chunk a few quantization levels. Rows are therefore scaled to an
    absmax of 1 first and the products scaled back: one activation scale per row (per token), as a
    decode row gets anyway.
    """

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = out_dtype
        self.scales = int8_scales(w)  # [out] f32
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # deprecated in name only; fbgemm has no other entry point
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, self.scales.double(), zero, 0, torch.qint8)
        # The bias is added after the per-row rescaling, so it is not packed with the weights.
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)  # [out] f32 or None
        self.packed = torch.ops.quantized.linear_prepack(q, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features).float()  # [rows, in] f32
        if flat.shape[0] > 1:
            row = flat.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)  # [rows, 1]
            scaled = flat.div_(row) if flat.data_ptr() != x.data_ptr() else flat / row  # never the caller's x
            y = torch.ops.quantized.linear_dynamic(scaled, self.packed, True).mul_(row)  # [rows, out]
        else:  # one row: its own scale already
            y = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(self.out_dtype or x.dtype).reshape(*x.shape[:-1], self.out_features)


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """w: [out, in] float -> per-output-channel scales [out] f32, symmetric: w ≈ round(w / s) * s."""
    return (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).float()


def resolve_weight_format(weights: str, dtype: torch.dtype, device: str, gguf_source: Path | None = None) -> str:
    """The format the linear layers get; `gguf_source`: the GGUF the model was prepared from, if kept."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if weights in GGUF_FORMATS:
        if gguf_source is None:
            raise ValueError(f"weights={weights!r} needs a model prepared from a GGUF file that keeps it (the "
                             "default model, prepared again with `specmesh models prepare --force` if it predates this)")
        if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
            raise ValueError(f"weights={weights!r} serves bf16 activations on the CPU (--dtype bfloat16)")
        reason = cpu_gguf_linear.unavailable_reason()
        if reason is not None:
            log.warning("weights=%r cannot run here (%s): the GGUF's blocks dequantized to bf16 "
                        "instead (bf16-avx512)", weights, reason)
            return resolve_weight_format("bf16-avx512" if cpu_linear.available() else "auto", dtype, device)
        return weights
    if weights != "auto":
        return weights
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return "none"
    if dtype == torch.bfloat16 and gguf_source is not None and cpu_gguf_linear.auto_takes_blocks():
        # The file's own blocks for decode rows (fewer bytes a token), bf16 panels past 3 rows: the
        # outputs of bf16-avx512 bit for bit, faster at one row (docs/kernels.md, README).
        return "gguf-bf16"
    if dtype == torch.bfloat16 and cpu_linear.available():
        return "bf16-avx512"  # faster than oneDNN's bf16 at one row, as fast from 18 rows up
    return "bf16" if dtype == torch.bfloat16 and native_bf16_cpu() else "fp16"


def prepack_linears(model: nn.Module, weights: str, gguf_source: Path | None = None) -> int:
    """Replaces every nn.Linear of `model` by its packed form (in place); returns how many.

    The lm_head is replaced too (its outputs stay float32); a tied input embedding keeps its
    own tensor, so embedding lookups are unchanged (the lean forwards look up in the lm_head's
    GGUF blocks instead where it has them: gguf_weights.tied_embedding_rows).
    """
    if weights == "none":
        return 0
    if weights in GGUF_FORMATS:
        from services.target.model.gguf_weights import pack_gguf_linears
        if gguf_source is None:
            raise ValueError(f"weights={weights!r} needs the GGUF file the model was prepared from")
        return pack_gguf_linears(model, gguf_source, with_bf16=weights == "gguf-bf16")
    classes = {"bf16": PackedLinearBF16, "bf16-avx512": AVX512LinearBF16, "fp16": PackedLinearFP16,
               "int8": Int8Linear}
    if weights not in classes:
        raise ValueError(f"cannot pack linear layers as {weights!r}")
    if weights == "bf16" and not native_bf16_cpu():
        raise ValueError("weights='bf16' needs a CPU with native bf16 (AVX512-BF16 or AMX); "
                         "use --weights fp16 or auto on this machine")
    if weights == "bf16-avx512" and not cpu_linear.available():
        raise ValueError(f"weights='bf16-avx512' cannot run here: {cpu_linear.unavailable_reason()}; "
                         "use --weights bf16 or auto")
    cls = classes[weights]
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lm_head = getattr(lm_head, "shard", lm_head)  # a tensor-parallel rank's slice of it (tp/shard.py)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        out_dtype = torch.float32 if module is lm_head else None
        setattr(parent, attr, cls(module, out_dtype))
    return len(targets)
