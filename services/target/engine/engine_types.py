"""Errors and statistics the engine hands to its callers."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequest(ValueError):
    """The request can never be served as given (maps to INVALID_ARGUMENT)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field  # the offending request field, e.g. "sampling.logit_bias" ("" = none named)


class DuplicateRequest(InvalidRequest):
    """A request id already in flight; the request holding it is not affected."""


class Overloaded(RuntimeError):
    """Admission limits are reached (maps to RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size: int
    running: int
    waiting: int
    queued_tokens: int
    num_preemptions: int
    evictions: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kv_bytes: int
    fragmentation: float  # allocated-but-unused slots / allocated slots
    prompt_tokens_computed: int = 0  # prompt positions computed (not served by the prefix cache or a fork)
    # The host tier below the pool (services/target/engine/host_tier.py); zeros when off.
    host_tier_capacity_bytes: int = 0
    host_tier_bytes: int = 0  # held now
    host_tier_blocks: int = 0  # entries held now
    host_tier_stored_blocks: int = 0  # evicted blocks stored (counter)
    host_tier_restored_blocks: int = 0  # blocks restored instead of recomputed (counter)
    host_tier_restored_tokens: int = 0  # prompt tokens those held (counter)
    host_tier_dropped_blocks: int = 0  # dropped to keep the byte bound (counter)
    host_tier_rejected_blocks: int = 0  # failed the identity, length or checksum check: recomputed (counter)
    host_tier_store_seconds: float = 0.0  # copying out and checksumming (counter)
    host_tier_restore_seconds: float = 0.0  # checking and copying back (counter)
    # The shared tier in Redis (services/target/engine/shared_tier.py); zeros when off.
    shared_tier_capacity_bytes: int = 0  # this replica's byte bound there
    shared_tier_bytes: int = 0  # bytes of this replica's entries there now
    shared_tier_written_blocks: int = 0  # entries written (counter)
    shared_tier_deleted_blocks: int = 0  # own entries deleted for the bound (counter)
    shared_tier_dropped_writes: int = 0  # writes dropped: queue full, too big or Redis down (counter)
    shared_tier_loaded_blocks: int = 0  # checked entries loaded into the host tier (counter)
    shared_tier_restored_blocks: int = 0  # of those, restored into the pool instead of recomputed (counter)
    shared_tier_restored_tokens: int = 0  # prompt tokens those held (counter)
    shared_tier_rejected_blocks: int = 0  # failed the identity, key, length or checksum check (counter)
    shared_tier_errors: int = 0  # Redis calls failed or timed out: recomputed (counter)
    shared_tier_write_seconds: float = 0.0  # framing and writing, off the engine thread (counter)
    shared_tier_load_seconds: float = 0.0  # fetching and checking, before requests queue (counter)
    recompute_seconds_per_block: float = 0.0  # measured (host tier on); the router prices tier hits with it
    # Preemption (of num_preemptions): swapped out to the host tier, or recomputed (services/target/engine/
    # scheduler.py); the swaps' bytes are part of host_tier_bytes and its bound.
    swap_preemptions: int = 0  # (counter)
    recompute_preemptions: int = 0  # (counter)
    host_tier_swap_bytes: int = 0  # held now for swapped-out sequences
    host_tier_swapped_out_blocks: int = 0  # (counter)
    host_tier_swapped_in_blocks: int = 0  # (counter)
    host_tier_swap_out_seconds: float = 0.0  # (counter)
    host_tier_swap_in_seconds: float = 0.0  # (counter)
    swap_seconds_per_block: float = 0.0  # measured copy out + in of one block (0 until measured)
    # Host-tier copies of long prefixes' later blocks in FP8 (services/target/engine/kv_precision.py).
    host_tier_cold_precision: str = "off"  # the policy as resolved: off | fp8 | fp8-under-pressure
    host_tier_cold_blocks: int = 0  # of host_tier_blocks, held in FP8 now
    host_tier_cold_bytes: int = 0  # of host_tier_bytes, held by them
    host_tier_cold_stored_blocks: int = 0  # of host_tier_stored_blocks, stored in FP8 (counter)
    host_tier_cold_restored_blocks: int = 0  # of restored blocks, decoded from FP8 (counter)
    host_tier_cold_setting: str = "off"  # kv_cold_precision as configured: off | fp8 | auto
    host_tier_cold_reason: str = ""  # why it resolved to host_tier_cold_precision
    host_tier_cold_swapped_out_blocks: int = 0  # of host_tier_swapped_out_blocks, stored in FP8 (counter)
    # Bytes of restored host-tier entries as stored (FP8 ones at their FP8 size): over
    # host_tier_restore_seconds, the tier's measured restore bandwidth (counter).
    host_tier_restore_bytes: int = 0
    host_tier_restore_bandwidth: float = 0.0  # host_tier_restore_bytes / host_tier_restore_seconds (0: unmeasured)
    kv_block_bytes: int = 0  # one block's KV in every layer, in the pool's dtype


class EngineFailed(RuntimeError):
    """The engine's loop failed outside a step and stopped: its state can no longer be trusted.
    Live requests end with INTERNAL; new ones are refused (maps to UNAVAILABLE: another replica,
    or this one once its supervisor restarted it)."""


class RankLost(EngineFailed):
    """A rank of a tensor-parallel target died or stopped answering (services/target/tp/): the
    replica cannot compute a step. The engine fails as a whole (`EngineFailed`), and its live
    requests end with UNAVAILABLE, not INTERNAL: nothing was wrong with them, another replica
    (or this one, restarted) can serve them."""
