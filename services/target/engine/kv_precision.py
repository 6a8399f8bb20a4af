"""KV precision of the host tier's copies: long prefixes' cold blocks kept in FP8.

The host tier (services/target/engine/host_tier.py) holds evicted prefix blocks' KV as raw bytes
in the pool's layout. Under `kv_cold_precision` a block that starts at or past
`kv_cold_after_tokens` can be stored instead in the format `--kv-dtype fp8` pools use
(services/target/kernels/kv_store.py: float8_e4m3fn with one float32 scale per token per KV
head), so the tier holds about 4x (float32 pool) or 2x (bf16 pool) as many of them, and is
dequantized into the pool's dtype when restored. The same policy picks the precision of a
preempted sequence's swapped-out blocks (host_tier.HostTier.reserve_swap): those from
`kv_cold_after_tokens` on go FP8 when it says so, and come back dequantized when it resumes. The
first tokens of a prefix (system prompt, the attention sinks models lean on) always stay in full
precision.

A restored FP8 block is not the block that was computed: its values carry FP8's rounding, so
the continuation can differ from recompute. That is why the policy is opt-in per model:

* `off`: full precision always (restores are byte-equal to what was computed);
* `fp8`: every block past the length threshold is stored in FP8 (forced, for tests and for
  operators who measured their own model);
* `auto` (default): FP8 only when the model's accuracy cost, as measured by
  `benchmarks/kv_precision.py` and recorded in `kv_cold_measured.json` beside this module, is
  within `MIN_AGREEMENT` / `MAX_LOGPROB_GAP` for this model (its fingerprint), pool dtype and a
  threshold no smaller than the measured one, and then only under pressure: when storing the
  block in full precision would drop an older entry. Anything else: full precision.

The stored bytes are what the tier checksums and checks on load; decoding happens after.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from services.target.kernels.kv_store import quantize_fp8
from services.target.settings import KV_COLD_PRECISIONS

log = logging.getLogger(__name__)

# The bound `auto` holds a model to, teacher-forced on long prompts (benchmarks/kv_precision.py):
# greedy choices agree on at least this share of positions with the full-precision KV ...
MIN_AGREEMENT = 0.99
# ... and the reference's choice loses at most this much log-probability on average (nats).
MAX_LOGPROB_GAP = 0.02
MEASURED_PATH = Path(__file__).with_name("kv_cold_measured.json")
FP8 = torch.float8_e4m3fn
FULL, COLD = "full", "fp8"  # an entry's precision
# The policy as resolved from the setting: never, always (past the threshold), or under pressure.
COLD_MODES = ("off", "fp8", "fp8-under-pressure")


@dataclass(frozen=True)
class PoolLayout:
    """A block's KV tensors in the pool's order (ModelRunner._caches): every layer's keys, then
    values (a pool that is not FP8 has no scale tensors)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the pool

    @property
    def full_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def cold_bytes(self) -> int:
        """fp8 values (1 byte) and a float32 scale per token per head, for keys and values of every layer."""
        rows = 2 * self.num_layers * self.block_size * self.num_kv_heads
        return rows * self.head_dim + rows * 4


class Fp8BlockCodec:
    """Full-precision block bytes <-> the FP8 pool's block bytes (fp8 keys, fp8 values, key scales,
    value scales, each every layer in order: what `--kv-dtype fp8` pools hold)."""

    def __init__(self, layout: PoolLayout) -> None:
        if layout.dtype == FP8:
            raise ValueError("the pool is FP8 already: its host-tier copies are FP8 as they are")
        self.layout = layout

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, full_bytes] uint8 -> [n, cold_bytes] uint8."""
        lay, n = self.layout, rows.shape[0]
        per_tensor = lay.full_bytes // (2 * lay.num_layers)
        values, scales = [], []
        for t in range(2 * lay.num_layers):  # keys of every layer, then values
            chunk = rows[:, t * per_tensor:(t + 1) * per_tensor].contiguous().view(lay.dtype)
            q, s = quantize_fp8(chunk.view(n * lay.block_size, lay.num_kv_heads, lay.head_dim))
            values.append(q.view(torch.uint8).reshape(n, -1))  # [n, block_size * heads * head_dim]
            scales.append(s.view(torch.uint8).reshape(n, -1))  # [n, block_size * heads * 4]
        return torch.cat(values + scales, dim=1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, cold_bytes] uint8 -> [n, full_bytes] uint8 in the pool's dtype."""
        lay, n = self.layout, rows.shape[0]
        tokens = n * lay.block_size
        width = lay.block_size * lay.num_kv_heads * lay.head_dim  # fp8 bytes of one tensor's block
        scale_at = 2 * lay.num_layers * width
        scale_width = lay.block_size * lay.num_kv_heads * 4
        out = []
        for t in range(2 * lay.num_layers):
            q = rows[:, t * width:(t + 1) * width].contiguous().view(FP8).view(tokens, lay.num_kv_heads, lay.head_dim)
            s = rows[:, scale_at + t * scale_width:scale_at + (t + 1) * scale_width].contiguous()
            s = s.view(torch.float32).view(tokens, lay.num_kv_heads, 1)
            full = (q.float() * s).to(lay.dtype)  # [tokens, heads, head_dim]
            out.append(full.view(torch.uint8).reshape(n, -1))
        return torch.cat(out, dim=1)


@dataclass(frozen=True)
class MeasuredCost:
    """One measurement of benchmarks/kv_precision.py, as recorded."""

    greedy_agreement: float
    mean_logprob_gap: float  # nats
    positions: int
    after_tokens: int  # the threshold it was measured with
    kv_dtype: str  # the pool dtype it was measured on (str(torch dtype))

    @property
    def within_bound(self) -> bool:
        return self.greedy_agreement >= MIN_AGREEMENT and self.mean_logprob_gap <= MAX_LOGPROB_GAP


class ColdPrecision:
    """The host tier's choice of precision per stored block, and the codec it stores with."""

    def __init__(self, mode: str, after_tokens: int, codec: Fp8BlockCodec | None, reason: str = "") -> None:
        if mode not in COLD_MODES:
            raise ValueError(f"cold precision mode must be one of {', '.join(COLD_MODES)}, got {mode!r}")
        if mode != "off" and codec is None:
            raise ValueError(f"cold precision {mode!r} needs a codec")
        self.mode = mode  # as resolved from the setting; GetStats and metrics show it
        self.after_tokens = after_tokens
        self.codec = codec
        self.reason = reason  # why it resolved to this mode (logged at start)

    def wants_cold(self, start_token: int, room_short: bool) -> bool:
        """Store the block starting at `start_token` in FP8? `room_short`: storing it in full
        precision would drop an older entry of the tier."""
        if self.mode == "off" or start_token < self.after_tokens:
            return False
        return self.mode == "fp8" or room_short


def build_cold_precision(setting: str, after_tokens: int, layout: PoolLayout, model_dir: Path | None,
                         measured_path: Path = MEASURED_PATH) -> ColdPrecision:
    """The policy for `setting` (settings.KV_COLD_PRECISIONS) on this model and pool."""
    if setting not in KV_COLD_PRECISIONS:
        raise ValueError(f"kv_cold_precision must be one of {', '.join(KV_COLD_PRECISIONS)}, got {setting!r}")
    if setting == "off":
        return ColdPrecision("off", after_tokens, None, "off by setting")
    if layout.dtype == FP8:
        if setting == "fp8":
            raise ValueError("kv_cold_precision 'fp8' with an FP8 pool: its host-tier copies are FP8 already")
        return ColdPrecision("off", after_tokens, None, "the pool is FP8 already")
    codec = Fp8BlockCodec(layout)
    if setting == "fp8":
        return ColdPrecision("fp8", after_tokens, codec, "fp8 by setting")
    cost = measured_cost(model_dir, str(layout.dtype), measured_path) if model_dir is not None else None
    if cost is None:
        return ColdPrecision("off", after_tokens, None, "auto: no measured accuracy cost for this model and pool dtype")
    if after_tokens < cost.after_tokens:
        return ColdPrecision("off", after_tokens, None, f"auto: measured from token {cost.after_tokens} on, "
                             f"not from {after_tokens}")
    summary = (f"measured greedy agreement {cost.greedy_agreement:.4f} (bound >= {MIN_AGREEMENT}), "
               f"log-prob gap {cost.mean_logprob_gap:.4f} nats (bound <= {MAX_LOGPROB_GAP}) over {cost.positions} "
               "positions")
    if not cost.within_bound:
        return ColdPrecision("off", after_tokens, None, f"auto: outside the bound: {summary}")
    return ColdPrecision("fp8-under-pressure", after_tokens, codec,
                         f"auto: within the measured bound, FP8 under pressure: {summary}")


def model_fingerprint(model_dir: Path) -> str:
    """A cheap digest of a model directory: its config and its weight files' sizes, heads and tails
    (tiny seeded models of one shape differ in their weights, not their config)."""
    digest = hashlib.blake2b(digest_size=16)
    model_dir = Path(model_dir)
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def read_measurements(path: Path = MEASURED_PATH) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def measured_cost(model_dir: Path, kv_dtype: str, path: Path = MEASURED_PATH) -> MeasuredCost | None:
    """The recorded measurement of this model (by fingerprint) on a pool of `kv_dtype`, if any."""
    try:
        record = read_measurements(path).get(model_fingerprint(model_dir), {}).get(kv_dtype)
    except (OSError, ValueError) as exc:  # an unreadable record is no measurement: full precision
        log.warning("kv cold precision: cannot read %s (%s)", path, exc)
        return None
    if record is None:
        return None
    return MeasuredCost(record["greedy_agreement"], record["mean_logprob_gap"], record["positions"],
                        record["after_tokens"], kv_dtype)


def record_measurement(model_dir: Path, cost: MeasuredCost, note: dict, path: Path = MEASURED_PATH) -> None:
    """Stores `cost` as this model's measurement on its pool dtype (benchmarks/kv_precision.py --record)."""
    records = read_measurements(path)
    entry = records.setdefault(model_fingerprint(model_dir), {})
    entry[cost.kv_dtype] = dict(greedy_agreement=cost.greedy_agreement, mean_logprob_gap=cost.mean_logprob_gap,
                                positions=cost.positions, after_tokens=cost.after_tokens, **note)
    path.write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
