"""Which build of specmesh's CPU kernel module a CPU gets (services/target/kernels/cpu_kernels.py):
AVX-512 where the CPU has it, else AVX2 + FMA + F16C, each under its own name in torch's
extension cache, and what the AVX2 build refuses (VDPBF16PS)."""

from __future__ import annotations

import pytest
import torch

from services.target.kernels import cpu_kernels, cpu_linear, cpu_rowops
from services.target.model import linear

AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"})
AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})


@pytest.mark.parametrize("flags,isa", [(AVX512, "avx512"), (AVX2, "avx2"), (AVX2 - {"fma"}, None),
                                       (frozenset({"sse4_2"}), None)])
def test_the_best_instruction_set_the_cpu_has_is_picked(monkeypatch, flags, isa):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    assert cpu_kernels.isa() == isa
    reason = cpu_kernels.unavailable_reason.__wrapped__()  # uncached: the real one is this CPU's
    if isa is None:
        assert "neither AVX-512" in reason and "AVX2 with FMA and F16C" in reason
    else:
        assert reason is None or "did not build" in reason


def test_each_isa_has_its_own_name_and_flags_in_the_extension_cache():
    # A cache shared by an AVX-512 and an AVX2 machine (an image built on one, run on the other)
    # must never hand one the other's build.
    assert cpu_kernels.extension_name("avx512") != cpu_kernels.extension_name("avx2")
    assert "-DSPECMESH_ISA_AVX512" in cpu_kernels.ISA_FLAGS["avx512"]
    assert "-DSPECMESH_ISA_AVX2" in cpu_kernels.ISA_FLAGS["avx2"]
    assert not any(flag.startswith("-mavx512") for flag in cpu_kernels.ISA_FLAGS["avx2"])


@pytest.mark.skipif(cpu_kernels.isa() is None, reason="the CPU has neither AVX-512 nor AVX2")
def test_a_cpu_with_avx2_or_avx512_gets_the_kernels_and_auto_picks_them():
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    assert cpu_kernels.module().__name__ == cpu_kernels.extension_name(cpu_kernels.isa())
    assert linear.resolve_weight_format("auto", torch.bfloat16, "cpu") == "bf16-avx512"


needs_avx2_build = pytest.mark.skipif(cpu_kernels.isa() != "avx2" or not cpu_kernels.available(),
                                      reason="this CPU does not run the AVX2 build")


@needs_avx2_build
def test_the_avx2_build_refuses_the_vdpbf16ps_paths_with_a_clear_error():
    assert not cpu_linear.bf16_dot_instruction()
    w = torch.ones(32, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="AVX512-BF16.*AVX2 build"):  # past the Python wrapper's check
        cpu_kernels.module().bf16_linear(torch.ones(1, 4, dtype=torch.bfloat16), cpu_linear.pack(w), 32, True)
    q = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="AVX512-BF16.*AVX2 build"):
        cpu_rowops.chunk_attention(q, cache, cache, torch.tensor([[0, 4, 0, 4]]), torch.tensor([[0]]),
                                   torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4]]), 0.5, torch.empty_like(q))


@needs_avx2_build
def test_the_argmax_screen_runs_on_the_avx2_build(monkeypatch):
    """Its int8 pass multiplies with VPMADDUBSW there (cpu_argmax_screen_avx2.h), so greedy rows read
    half the output layer's bytes on AVX2 CPUs too; only AMX tiles are refused."""
    from services.target.kernels import argmax_screen
    monkeypatch.delenv("SPECMESH_ARGMAX_SCREEN", raising=False)
    assert argmax_screen.unavailable_reason(640) is None
    from services.target.model import output_layer
    assert output_layer.screen_max_rows() == output_layer.SCREEN_MAX_ROWS_AVX2  # the widened whole layer is slower
    w = argmax_screen.quantize_weights(lambda ids: torch.ones(len(ids), 64, dtype=torch.bfloat16), 16, 64, block=64)
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    upper, best, columns = argmax_screen.bounds(x, w, amx=False)
    assert torch.allclose(upper, torch.full((1, 16), 64.0), atol=1e-2) and torch.equal(columns, torch.arange(16))
    with pytest.raises(RuntimeError, match="AMX-INT8.*AVX2 build"):
        argmax_screen.bounds(x, w, amx=True)


@needs_avx2_build
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 17])  # tails of the 8-lane loops: no 16-bit masked loads on AVX2
def test_the_avx2_tails_read_and_write_only_their_lanes(n):
    g = torch.Generator().manual_seed(n)
    row = (torch.randn(3, n + 8, generator=g) * 2).to(torch.bfloat16)
    x = row[:, :n]  # strided rows: whatever follows a row's n values must not leak in
    w = torch.ones(n)
    ours = cpu_rowops.rms_norm(x, w, 1e-6)
    theirs = torch.rms_norm(x.float(), (n,), w, 1e-6).to(torch.bfloat16)
    assert bool(((ours.float() - theirs.float()).abs() <= theirs.float().abs() * 2.0**-7 + 1e-30).all())
    gate_up = torch.cat([x, x], 1).contiguous()  # [3, 2n]
    out = cpu_rowops.gelu_tanh_mul(gate_up)
    expected = torch.nn.functional.gelu(x, approximate="tanh") * x
    plain = x.float() > -3  # below, 1 + tanh cancels (tests/target/test_cpu_rowops.py): within 1e-3
    assert out.shape == (3, n) and torch.equal(out[plain], expected[plain])
    assert bool(((out.float() - expected.float()).abs()[~plain] < 1e-3).all())
    scores = x.reshape(1, 3, n).contiguous()
    probs = cpu_rowops.masked_softmax_(scores.clone(), None)
    assert bool(((probs.float() - torch.softmax(scores.float(), -1)).abs() <= 2.0**-8).all())
    assert bool((probs.float().sum(-1) - 1).abs().max() < 0.02)
