"""The GGUF block kernel (services/target/kernels/cpu_gguf_linear.cpp) against today's path: the same
blocks dequantized by gguf.quants, rounded to bf16, packed and multiplied by bf16_linear (its VDPBF16PS
loop, or on AVX2 its widen + FMA loop). Outputs must be equal bit for bit (torch.equal), for every
block type the default model uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from services.target.kernels import cpu_gguf_linear, cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_gguf_linear.available(), reason=f"{cpu_gguf_linear.unavailable_reason()}")

TYPES = list(cpu_gguf_linear.BLOCK_TYPES)


def _blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """A random [n, k] weight quantized to `type_name` by gguf's own quantizer: [n, row bytes] uint8.

    gguf has no Q4_K / Q6_K quantizer, so those get random bytes with fp16 scales in a sane range
    (every bit pattern of the quants is a valid block)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if type_name in ("Q8_0", "Q5_0"):
        return quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    per_block, block_bytes, _ = cpu_gguf_linear.BLOCK_TYPES[type_name]
    blocks = rng.integers(0, 256, size=(n * k // per_block, block_bytes), dtype=np.uint8)
    scale_at = (0, 2) if type_name == "Q4_K" else (208,)  # d (and dmin) fp16
    for at in scale_at:
        blocks[:, at:at + 2] = (rng.uniform(1e-5, 2e-3, blocks.shape[0]).astype(np.float16)
                                * rng.choice([-1, 1], blocks.shape[0]).astype(np.float16)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _today(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """prepare.py's conversion: gguf.dequantize, float32, then bf16."""
    w = dequantize(raw, GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(torch.bfloat16)


@pytest.mark.parametrize("type_name", TYPES)
def test_decoded_blocks_round_to_todays_bf16(type_name: str) -> None:
    raw = _blocks(type_name, 48, 512, seed=1)
    parts = cpu_gguf_linear.decode_blocks(raw, type_name)
    assert torch.equal(cpu_gguf_linear.dequantize_bf16(parts), _today(raw, type_name))


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 12, 40, 130])
@pytest.mark.parametrize("n", [120, 200])
def test_gguf_linear_equals_bf16_linear(type_name: str, m: int, n: int) -> None:
    k = 512  # n not a multiple of 16 or 32: the tail group is masked; 200: an odd number of groups
    raw = _blocks(type_name, n, k, seed=2)
    packed = cpu_gguf_linear.pack(cpu_gguf_linear.decode_blocks(raw, type_name))
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
    expected = cpu_linear.bf16_linear(x, cpu_linear.pack(_today(raw, type_name)), n)  # as the engine runs it: AMX tiles where it takes them
    assert torch.equal(cpu_gguf_linear.gguf_linear(x, packed), expected)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 64])
def test_fused_mixed_block_types_equal_bf16_linear(m: int) -> None:
    """A fused projection whose parts have different block types (q/k/v: Q5_0, Q5_0, Q8_0; a down
    projection Q4_K or Q6_K), in one packed weight."""
    k = 512
    parts = [("Q5_0", 64), ("Q4_K", 32), ("Q6_K", 48), ("Q8_0", 16)]
    raws = [_blocks(t, n, k, seed=10 + i) for i, (t, n) in enumerate(parts)]
    packed = cpu_gguf_linear.pack(cpu_gguf_linear.concat(
        [cpu_gguf_linear.decode_blocks(r, t) for r, (t, _) in zip(raws, parts)]))
    weight = torch.cat([_today(r, t) for r, (t, _) in zip(raws, parts)])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = cpu_linear.bf16_linear(x, cpu_linear.pack(weight), weight.shape[0])
    assert torch.equal(cpu_gguf_linear.gguf_linear(x, packed), expected)
    ids = torch.tensor([0, 63, 64, 95, 96, 159, 70])  # a row of each part, mixed sub-blocks and offsets
    assert torch.equal(cpu_gguf_linear.rows(packed, ids), weight[ids])


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
def test_rows_are_the_embedding_rows(type_name: str) -> None:
    raw = _blocks(type_name, 40, 256, seed=4)
    packed = cpu_gguf_linear.pack(cpu_gguf_linear.decode_blocks(raw, type_name))
    ids = torch.tensor([0, 39, 17, 17, 5])  # 39: the masked tail group
    assert torch.equal(cpu_gguf_linear.rows(packed, ids), _today(raw, type_name)[ids])
    everything = torch.arange(40)
    assert torch.equal(cpu_gguf_linear.rows(packed, everything), _today(raw, type_name))
    with pytest.raises(RuntimeError, match="outside"):
        cpu_gguf_linear.rows(packed, torch.tensor([40]))


@pytest.mark.parametrize("type_name", TYPES)
def test_four_bit_blocks_pack_two_quants_a_byte(type_name: str) -> None:
    """Q4_K's q (all in [0, 15]) are stored as nibbles, half the bytes of the int8 layout, and read
    back as the same q; the other types keep a byte a weight."""
    parts = cpu_gguf_linear.decode_blocks(_blocks(type_name, 48, 256, seed=3), type_name)
    packed = cpu_gguf_linear.pack(parts)
    four_bit = type_name == "Q4_K"
    assert packed.nibbles == four_bit
    assert packed.quants.shape == (3, 128, 16 if four_bit else 32)
    assert torch.equal(packed.int8_quants().view(3, 128, 16, 2).permute(0, 2, 1, 3).reshape(48, 256),
                       torch.from_numpy(parts.q))
