"""The host tier's cold precision (services/target/engine/kv_precision.py): the FP8 codec is the
FP8 pool's own format, the policy picks FP8 by length and pressure only where the setting (and
for `auto` a measurement within the bound) allows, and FP8 entries are checked on their stored
bytes and decoded on the way back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.target.config import EngineConfig
from services.target.engine.host_tier import HostTier, TierIdentity
from services.target.engine.kv_precision import (
    COLD,
    MAX_LOGPROB_GAP,
    MIN_AGREEMENT,
    ColdPrecision,
    Fp8BlockCodec,
    MeasuredCost,
    PoolLayout,
    build_cold_precision,
    model_fingerprint,
    record_measurement,
)
from services.target.kernels.kv_store import store_kv_reference

LAYOUT = PoolLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
KEY = "model\x00salt"


def _pool_rows(n: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """n blocks of random KV as a float32 pool holds them: (rows [n, full_bytes] uint8, the
    per-tensor values [n * block_size, heads, head_dim] in the pool's order: keys, then values)."""
    g = torch.Generator().manual_seed(seed)
    lay = LAYOUT
    tensors = [torch.randn(n * lay.block_size, lay.num_kv_heads, lay.head_dim, generator=g) * (t + 1)
               for t in range(2 * lay.num_layers)]
    rows = torch.cat([t.view(n, -1).view(torch.uint8) for t in tensors], dim=1)
    return rows, tensors


def test_the_codec_writes_the_fp8_pools_own_bytes_and_decodes_within_fp8_rounding():
    n, lay = 3, LAYOUT
    rows, tensors = _pool_rows(n)
    codec = Fp8BlockCodec(lay)
    cold = codec.encode(rows)
    assert rows.shape == (n, lay.full_bytes) and cold.shape == (n, lay.cold_bytes)
    assert lay.cold_bytes == lay.full_bytes * (16 + 4) // (4 * 16)  # fp8 value + f32 scale per head row
    # What `--kv-dtype fp8` pools hold for the same KV: their caches (keys, values), then scales.
    shape = (n, lay.block_size, lay.num_kv_heads, lay.head_dim)
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in tensors]
    scales = [torch.ones(shape[:3]) for _ in tensors]
    slots = torch.arange(n * lay.block_size)
    layers = lay.num_layers
    for i in range(layers):
        store_kv_reference(tensors[i], tensors[layers + i], caches[i], caches[layers + i], slots,
                           scales[i], scales[layers + i])
    pool_bytes = torch.cat([t.view(torch.uint8).reshape(n, -1) for t in caches + scales], dim=1)
    assert torch.equal(cold, pool_bytes)
    back = codec.decode(cold)
    assert back.shape == rows.shape
    for t, original in enumerate(tensors):
        width = lay.full_bytes // len(tensors)
        decoded = back[:, t * width:(t + 1) * width].contiguous().view(torch.float32).view(original.shape)
        amax = original.abs().amax(-1, keepdim=True)
        assert ((decoded - original).abs() <= amax / 16).all()  # e4m3: 3 mantissa bits
        assert not torch.equal(decoded, original)  # lossy: not the computed block


def test_an_fp8_pool_has_no_cold_codec_and_auto_leaves_it_alone():
    fp8 = replace(LAYOUT, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8 already"):
        Fp8BlockCodec(fp8)
    assert build_cold_precision("auto", 0, fp8, None).mode == "off"
    with pytest.raises(ValueError, match="FP8 already"):
        build_cold_precision("fp8", 0, fp8, None)


def test_the_policy_picks_fp8_by_length_and_for_auto_only_under_pressure():
    codec = Fp8BlockCodec(LAYOUT)
    off = ColdPrecision("off", 0, None)
    always = ColdPrecision("fp8", 32, codec)
    pressure = ColdPrecision("fp8-under-pressure", 32, codec)
    assert not off.wants_cold(1000, True)
    assert [always.wants_cold(start, False) for start in (0, 28, 32, 1000)] == [False, False, True, True]
    assert [pressure.wants_cold(start, short) for start, short in ((0, True), (32, False), (32, True))] == [
        False, False, True]
    with pytest.raises(ValueError, match="one of"):
        build_cold_precision("fp4", 0, LAYOUT, None)


def test_auto_follows_the_recorded_measurement_of_this_model_and_pool_dtype(tmp_path, tiny_llama_dir):
    record = tmp_path / "measured.json"
    assert build_cold_precision("auto", 256, LAYOUT, tiny_llama_dir, record).mode == "off"  # nothing measured
    good = MeasuredCost(MIN_AGREEMENT + 0.005, MAX_LOGPROB_GAP / 2, 1000, 256, str(torch.float32))
    record_measurement(tiny_llama_dir, good, {"command": "test"}, record)
    policy = build_cold_precision("auto", 256, LAYOUT, tiny_llama_dir, record)
    assert policy.mode == "fp8-under-pressure" and "bound" in policy.reason
    assert build_cold_precision("auto", 128, LAYOUT, tiny_llama_dir, record).mode == "off"  # fewer exact tokens
    bf16 = replace(LAYOUT, dtype=torch.bfloat16)
    assert build_cold_precision("auto", 256, bf16, tiny_llama_dir, record).mode == "off"  # other pool dtype
    bad = replace(good, greedy_agreement=MIN_AGREEMENT - 0.01)
    record_measurement(tiny_llama_dir, bad, {}, record)
    policy = build_cold_precision("auto", 256, LAYOUT, tiny_llama_dir, record)
    assert policy.mode == "off" and "outside the bound" in policy.reason
    assert build_cold_precision("fp8", 256, LAYOUT, tiny_llama_dir, record).mode == "fp8"  # forced


def test_the_fingerprint_tells_checkpoints_of_one_shape_apart(tmp_path):
    from services.common.models.tiny import build_tiny_model
    a = build_tiny_model(tmp_path / "a", arch="llama", seed=0)
    b = build_tiny_model(tmp_path / "b", arch="llama", seed=1)
    assert (Path(a) / "config.json").read_bytes() == (Path(b) / "config.json").read_bytes()
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(a)


def _tier(mode: str, capacity: int, after: int = 0) -> HostTier:
    cold = ColdPrecision(mode, after, Fp8BlockCodec(LAYOUT) if mode != "off" else None)
    return HostTier(capacity, TierIdentity("model", str(LAYOUT.dtype), LAYOUT.block_size, LAYOUT.full_bytes), cold)


def test_fp8_entries_are_smaller_checked_on_their_stored_bytes_and_decoded_when_served():
    rows, _ = _pool_rows(4)
    tier = _tier("fp8", 1 << 20, after=4)  # the first block of a prefix stays exact
    keys = [(None, (i,), KEY) for i in range(4)]
    for i, key in enumerate(keys):
        assert tier.store(i, key, rows[i], start_token=i * LAYOUT.block_size)
    assert [tier.entry_of(i).precision for i in range(4)] == ["full", COLD, COLD, COLD]
    assert tier.entry_of(1).num_bytes == LAYOUT.cold_bytes < LAYOUT.full_bytes
    s = tier.stats()
    assert (s.cold_precision, s.cold_entries, s.cold_stored_blocks, s.stored_blocks) == ("fp8", 3, 3, 4)
    assert s.used_bytes == LAYOUT.full_bytes + 3 * LAYOUT.cold_bytes and s.cold_bytes == 3 * LAYOUT.cold_bytes
    exact = tier.take_entry(0, keys[0])
    assert torch.equal(tier.full_bytes(exact), rows[0])  # full precision: byte-equal
    served = tier.take_entry(1, keys[1])
    assert torch.equal(tier.full_bytes(served), Fp8BlockCodec(LAYOUT).decode(served.data.view(1, -1))[0])
    assert not torch.equal(tier.full_bytes(served), rows[1])
    tier.entry_of(2).data[7] ^= 0x01  # one fp8 value flipped after its checksum
    assert tier.take_entry(2, keys[2]) is None
    s = tier.stats()
    assert (s.restored_blocks, s.cold_restored_blocks, s.rejected_blocks) == (2, 1, 1)
    off = _tier("off", 1 << 20)  # a tier without the policy serves no FP8 entry
    off.put(3, tier.entry_of(3))
    assert off.take_entry(3, keys[3]) is None and off.stats().rejected_blocks == 1


def test_under_pressure_only_blocks_that_would_push_an_older_entry_out_go_fp8_and_the_bound_holds():
    rows, _ = _pool_rows(12)
    capacity = 3 * LAYOUT.full_bytes + LAYOUT.full_bytes // 2
    tier = _tier("fp8-under-pressure", capacity)
    for i in range(12):
        tier.store(i, (None, (i,), KEY), rows[i], start_token=64)
        assert tier.stats().used_bytes <= capacity
    s = tier.stats()
    assert s.cold_stored_blocks == 12 - 3  # the first three fitted in full precision, then it was full
    # The full entries were the oldest and went first; nine FP8 blocks where three full ones fitted.
    assert [tier.entry_of(h).precision for h in tier.hashes()] == [COLD] * 9
    assert s.entries == 9 and s.used_bytes <= capacity


def test_restored_fp8_kv_keeps_a_tiny_fp32_model_close_to_recompute_teacher_forced(tiny_llama_dir):
    from services.bench.kv_precision import restored_agreement
    from services.target.engine.engine import Engine
    results = {}
    for setting in ("off", "fp8"):
        engine = Engine.load(EngineConfig(model_dir=tiny_llama_dir, dtype="float32", num_blocks=64, block_size=4,
                                          kernels="cpu", kv_cold_precision=setting, kv_cold_after_tokens=8))
        try:
            g = torch.Generator().manual_seed(0)
            texts = [torch.randint(3, 200, (48,), generator=g).tolist() for _ in range(8)]  # 32 + 16 read
            results[setting] = engine.run_on_engine_thread(restored_agreement, engine, texts, 32)
            cold = engine.stats().host_tier_cold_restored_blocks
            assert cold == (0 if setting == "off" else 8 * (32 - 8) // 4)  # past the first 8 tokens
        finally:
            engine.shutdown()
    off, fp8 = results["off"], results["fp8"]
    assert (off.positions, off.greedy_agreement, off.mean_logprob_gap) == (128, 1.0, 0.0)  # exact restores
    # Measured: 116 of 128 positions (0.906), mean log-prob gap 0.0032 nats. A tiny random model's flat
    # logits flip on far smaller changes than a trained model's (benchmarks/kv_precision.py).
    assert fp8.positions == 128 and fp8.greedy_agreement >= 0.85 and 0 < fp8.mean_logprob_gap < 0.02


def test_engine_config_refuses_bad_cold_precision_settings(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cold_precision='fp4'.*'auto', 'off' or 'fp8'"):
        EngineConfig(model_dir=tiny_llama_dir, kv_cold_precision="fp4")
    with pytest.raises(ValueError, match="kv_cold_after_tokens=-1"):
        EngineConfig(model_dir=tiny_llama_dir, kv_cold_after_tokens=-1)
    with pytest.raises(ValueError, match="needs a host tier"):
        EngineConfig(model_dir=tiny_llama_dir, kv_cold_precision="fp8", kv_dtype="fp8")
    with pytest.raises(ValueError, match="needs a host tier"):
        EngineConfig(model_dir=tiny_llama_dir, kv_cold_precision="fp8", kv_host_bytes=0)


def test_a_bad_setting_names_the_allowed_values():
    from services.settings import read_settings
    with pytest.raises(ValueError) as exc:
        read_settings({"SPECMESH_KV_COLD_PRECISION": "int4"})
    assert "kv_cold_precision='int4'" in str(exc.value) and "'auto', 'off' or 'fp8'" in str(exc.value)
    assert read_settings({"SPECMESH_KV_COLD_PRECISION": "fp8"}).target.kv_cold_precision == "fp8"
