"""The replicas of one pool: health, load, and the choice of a replica for a request.

A background task per pool polls every replica (standard health check + `GetStats`) every
`poll_interval_s`: a replica that fails is *ejected* (never chosen) until a check succeeds
again (*rejoin*). A request that fails on a replica before its first token ejects it at
once (`mark_failed`) and re-resolves the pool's DNS entries soon. Entries `dns:///name:port`
are re-resolved on every poll (services/common/dns_replicas.py): a Kubernetes headless
Service's pods become replicas as they come and go, each named by its own DNS name (the
replica key here, in the prefix index and in the route record, and the channel target, so
its certificate is checked against that name).

Replica choice (`choose`), per `policy`:
- `round_robin`: the next healthy replica in turn.
- `least_loaded`: the least `load_tokens` (running + queued work).
- `kv_aware` (default): the least `uncached prompt tokens + load_weight · load_tokens`, where
  the cached prefix comes from the cache service's prefix index, or from a prompt this router
  has in flight on the replica (`Replica.sent_blocks`: computed there, or being computed, before
  the index hears of it). `load_weight` is 1/2 (`LOAD_WEIGHT`): the uncached tokens delay this
  request and then every request queued after it on that replica (the work it adds to the
  mesh), the load only this request — so a prefix is recomputed elsewhere only when its
  replica is more than two such recomputes behind. (At 1, a replica holding a 1000-token
  prefix behind one other 1000-token prefill lost to an idle one by the request's few
  uncached tokens: an even trade for this request that duplicated the prefix and cost the
  mesh 1000 tokens; on the multi-host benchmark those were all of kv_aware's misses.) Ties go
  to the replica with the least KV holding cached prefixes (a new prefix evicts less there),
  then in turn.
  A prefix held below the pool (the replica's host tier, or the shared tier) counts at its
  load cost (`Replica.cached_tokens`): each such block saves a recompute but costs its load, in
  recompute-equivalent tokens. A host-tier block costs the replica's mean stored bytes per block
  (less where its tier holds FP8 copies) over its measured restore bandwidth; a shared-tier block
  the measured Redis load per block plus a full block over that bandwidth (`ReplicaStats`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.dns_replicas import DnsReplicas
from services.router.settings import REPLICA_POLICIES as POLICIES
from specmesh.proto.v1 import target_service_pb2, target_service_pb2_grpc

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 2.0  # a busy replica answers health and stats slowly, not never
EJECT_AFTER_SLOW_CHECKS = 3  # consecutive timed-out checks before a replica is ejected
LOAD_WEIGHT = 0.5  # kv_aware: load tokens per uncached prompt token (module docstring)


@dataclass
class ReplicaStats:
    """The last `GetStats` answer of a replica (router-side copy)."""

    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    block_size: int = 16
    cache_model_id: str = ""
    host_tier_bytes: int = 0  # the host tier below the pool (zeros when off)
    host_tier_capacity_bytes: int = 0
    host_tier_restored_blocks: int = 0
    shared_tier_bytes: int = 0  # the replica's entries in the shared tier (zeros when off)
    shared_tier_capacity_bytes: int = 0
    shared_tier_restored_blocks: int = 0
    # What a tier hit costs, measured (0 = not measured yet): the host tier's restore bandwidth
    # (bytes per second as stored), the bytes its prefix entries hold per block now (smaller where
    # they are FP8; 0 = none held, priced as full blocks), a full block's bytes, the shared tier's
    # Redis load per block; and what recomputing a block costs.
    restore_bytes_per_s: float = 0.0
    host_bytes_per_block: float = 0.0
    block_bytes: int = 0
    shared_redis_s_per_block: float = 0.0
    recompute_s_per_block: float = 0.0
    # Precision of the host tier's copies (kv_cold_precision): as configured, as resolved, why;
    # the FP8 blocks and bytes it holds now (shown by ListModels and `specmesh status`).
    cold_setting: str = ""
    cold_precision: str = ""
    cold_reason: str = ""
    host_tier_cold_blocks: int = 0
    host_tier_cold_bytes: int = 0

    @property
    def host_restore_s_per_block(self) -> float:
        """A host-tier hit: the replica's mean stored bytes per block over its measured restore
        bandwidth (0 while unmeasured)."""
        return _over(self.host_bytes_per_block or self.block_bytes, self.restore_bytes_per_s)

    @property
    def shared_load_s_per_block(self) -> float:
        """A shared-tier hit: the Redis load, then a full-precision block restored through the host
        tier (shared entries are never FP8); each part 0 while unmeasured."""
        return self.shared_redis_s_per_block + _over(self.block_bytes, self.restore_bytes_per_s)


def replica_stats(s: target_service_pb2.GetStatsResponse) -> ReplicaStats:
    """The router's copy of a replica's `GetStats` answer."""
    entries = s.host_tier_bytes - s.host_tier_swap_bytes  # prefix entries' bytes (swapped sequences' aside)
    return ReplicaStats(
        s.running_requests, s.waiting_requests, s.queued_tokens, s.num_blocks, s.free_blocks, s.cached_blocks,
        s.block_size or 16, s.cache_model_id, s.host_tier_bytes, s.host_tier_capacity_bytes,
        s.host_tier_restored_blocks, s.shared_tier_bytes, s.shared_tier_capacity_bytes,
        s.shared_tier_restored_blocks, restore_bytes_per_s=s.host_tier_restore_bandwidth,
        host_bytes_per_block=entries / s.host_tier_blocks if s.host_tier_blocks and entries > 0 else 0.0,
        block_bytes=s.kv_block_bytes,
        shared_redis_s_per_block=s.shared_tier_load_seconds / s.shared_tier_loaded_blocks
        if s.shared_tier_loaded_blocks else 0.0, recompute_s_per_block=s.recompute_seconds_per_block,
        cold_setting=s.host_tier_cold_setting, cold_precision=s.host_tier_cold_precision,
        cold_reason=s.host_tier_cold_reason, host_tier_cold_blocks=s.host_tier_cold_blocks,
        host_tier_cold_bytes=s.host_tier_cold_bytes)


class Replica:
    def __init__(self, address: str, channel: grpc.aio.Channel) -> None:
        self.address = address
        self.channel = channel
        self.stub = target_service_pb2_grpc.TargetServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self.healthy = True  # optimistic until a check fails
        self.failed_checks = 0  # consecutive
        self._checking: asyncio.Task | None = None  # the check in flight, shared by overlapping callers
        self.stats: ReplicaStats | None = None
        self.in_flight = 0  # requests this router has on it now
        self.in_flight_tokens = 0  # their uncached prompt until the first token, + max_tokens until the end
        self.sent: dict[object, list[int]] = {}  # a key per request in flight -> its prompt's block hashes

    @property
    def load_tokens(self) -> int:
        """Work ahead of a new request: the replica's queued prompt tokens plus the work left
        of what this router sent there (stats lag behind by up to one poll)."""
        queued = self.stats.queued_tokens if self.stats else 0
        return queued + self.in_flight_tokens

    def cached_tokens(self, device_blocks: int, host_blocks: int, shared_blocks: int, block_size: int) -> int:
        """Prefix tokens the replica would not recompute, as its score counts them: pool blocks in
        full; host- and shared-tier blocks less their load cost relative to recomputing (a tier
        the replica lacks, or one measured dearer than recompute, counts nothing; an unmeasured
        one counts in full, as the target itself restores until it has measured)."""
        s = self.stats or ReplicaStats()
        host_cost = _ratio(s.host_restore_s_per_block, s.recompute_s_per_block)
        shared_cost = _ratio(s.shared_load_s_per_block, s.recompute_s_per_block)
        host = host_blocks * (1 - host_cost) if s.host_tier_capacity_bytes else 0.0
        shared = shared_blocks * (1 - shared_cost) if s.shared_tier_capacity_bytes else 0.0
        return round((device_blocks + host + shared) * block_size)

    def sent_blocks(self, hashes: list[int]) -> int:
        """Leading blocks of `hashes` that a prompt this router has in flight here starts with:
        computed here, or being computed (its blocks are held while it runs), whether or not
        the prefix index has heard of them yet."""
        best = 0
        for sent in self.sent.values():
            n = 0
            for a, b in zip(hashes, sent):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    @property
    def cached_fraction(self) -> float:
        """Share of the KV pool holding cached prefixes (other requests' reuse we would evict)."""
        s = self.stats
        return s.cached_blocks / s.num_blocks if s and s.num_blocks else 0.0

    async def check(self, timeout: float, eject_after: int = 1) -> bool:
        """Health SERVING and stats read; updates `healthy` and `stats`.

        Refused connections and NOT_SERVING eject at once; a slow answer (a busy replica) only
        after `eject_after` consecutive failed checks. Calls that overlap share one check: a
        burst of finished requests refreshes a replica once, and one slow spell counts as one
        failure, not as one per request that ended in it.
        """
        if self._checking is None or self._checking.done():
            self._checking = asyncio.get_running_loop().create_task(
                self._check_once(timeout, eject_after), context=contextvars.Context())
        return await asyncio.shield(self._checking)

    def cancel_check(self) -> None:
        if self._checking is not None:
            self._checking.cancel()

    async def _check_once(self, timeout: float, eject_after: int) -> bool:
        try:
            health = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                raise ConnectionError("not serving")
            s = await self.stub.GetStats(target_service_pb2.GetStatsRequest(), timeout=timeout)
        except (grpc.aio.AioRpcError, ConnectionError) as exc:
            self.failed_checks += 1
            slow = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if self.healthy and (not slow or self.failed_checks >= eject_after):
                log.warning("replica %s ejected: %s", self.address, getattr(exc, "code", lambda: exc)())
                self.healthy = False
            return False
        self.failed_checks = 0
        self.stats = replica_stats(s)
        if not self.healthy:
            log.info("replica %s rejoined", self.address)
        self.healthy = True
        return True


class ReplicaSet:
    """One pool's replicas; owns their channels and the poll task."""

    def __init__(self, addresses: tuple[str, ...], channel_factory: Callable[[str], grpc.aio.Channel],
                 policy: str, poll_interval_s: float, load_weight: float = LOAD_WEIGHT) -> None:
        # policy and poll interval: the settings' (services/router/settings.py), no defaults here
        if policy not in POLICIES:
            raise ValueError(f"replica policy must be one of {POLICIES}, got {policy!r}")
        self.entries = addresses
        self.policy = policy
        self.poll_interval_s = poll_interval_s
        self.load_weight = load_weight
        self._channel_factory = channel_factory
        self._replicas: dict[str, Replica] = {}
        self._turn = 0
        self._task: asyncio.Task | None = None
        self._refreshes: set[asyncio.Task] = set()
        self._dns = DnsReplicas(addresses)
        self._resolving: asyncio.Task | None = None
        self._add(self._dns.listed())

    # ---- public API ------------------------------------------------------------
    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def healthy(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.healthy]

    def get(self, address: str) -> Replica | None:
        return self._replicas.get(address)

    def block_size(self) -> int | None:
        return next((r.stats.block_size for r in self._replicas.values() if r.stats), None)

    def cache_model_id(self) -> str | None:
        return next((r.stats.cache_model_id for r in self._replicas.values()
                     if r.stats and r.stats.cache_model_id), None)

    def choose(self, prompt_tokens: int, cached: dict[str, int], exclude: set[str] = frozenset(),
               peek: bool = False) -> Replica | None:
        """The replica for a request of `prompt_tokens`; `cached`: address -> cached prefix tokens.

        `peek` answers without taking a turn (for estimates before the pool is chosen).
        """
        candidates = [r for r in self._replicas.values() if r.healthy and r.address not in exclude]
        if not candidates:
            return None
        turn = self._turn if peek else self._take_turn()
        n = len(candidates)
        if self.policy == "round_robin":
            return candidates[turn % n]
        rotation = {r.address: (i - turn) % n for i, r in enumerate(candidates)}  # fair ties
        if self.policy == "least_loaded":
            return min(candidates, key=lambda r: (r.load_tokens, rotation[r.address]))
        return min(candidates, key=lambda r: (
            prompt_tokens - cached.get(r.address, 0) + self.load_weight * r.load_tokens,
            r.cached_fraction, rotation[r.address]))

    def _take_turn(self) -> int:
        self._turn += 1
        return self._turn - 1

    def refresh(self, replica: Replica) -> None:
        """Re-reads one replica's stats soon (after a request finished there), not waiting for it."""
        task = asyncio.get_running_loop().create_task(  # not part of the request's trace
            replica.check(CHECK_TIMEOUT_S, EJECT_AFTER_SLOW_CHECKS), context=contextvars.Context())
        self._refreshes.add(task)
        task.add_done_callback(self._refreshes.discard)

    def mark_failed(self, replica: Replica) -> None:
        """A call failed before its first token: eject until the next good check, and look
        the pool's DNS entries up again now (the pod may be gone or replaced)."""
        replica.healthy = False
        if self._dns.dynamic and (self._resolving is None or self._resolving.done()):
            self._resolving = asyncio.get_running_loop().create_task(
                self._resolve(), context=contextvars.Context())

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.get_running_loop().create_task(self._poll_forever(), context=contextvars.Context())

    async def poll_once(self) -> None:
        await self._resolve()
        await asyncio.gather(*(r.check(CHECK_TIMEOUT_S, EJECT_AFTER_SLOW_CHECKS)
                               for r in list(self._replicas.values())))

    async def close(self) -> None:
        for task in [self._task, self._resolving, *self._refreshes]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for replica in self._replicas.values():
            replica.cancel_check()
        await asyncio.gather(*(r.channel.close() for r in self._replicas.values()), return_exceptions=True)

    # ---- helpers ---------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # never let the poller die
                log.exception("replica poll failed")
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    async def _resolve(self) -> None:
        """Expands dns:/// entries (off the event loop); adds new replicas, drops vanished ones."""
        added, removed = await self._dns.changes(self._replicas.keys())
        for address in added:
            log.info("replica %s found by DNS", address)
        self._add(added)
        gone = [self._replicas.pop(address) for address in removed]
        for replica in gone:
            log.info("replica %s left DNS: removed", replica.address)
            replica.cancel_check()
            await replica.channel.close()

    def _add(self, addresses) -> None:
        for address in addresses:
            self._replicas[address] = Replica(address, self._channel_factory(address))


def _over(num_bytes: float, bytes_per_s: float) -> float:
    """Seconds to move `num_bytes` at `bytes_per_s`; 0 while either is unknown."""
    return num_bytes / bytes_per_s if num_bytes > 0 and bytes_per_s > 0 else 0.0


def _ratio(load_s: float, recompute_s: float) -> float:
    """A tier block's load cost as a share of recomputing it, in [0, 1]; 0 while unmeasured."""
    if load_s <= 0 or recompute_s <= 0:
        return 0.0
    return min(1.0, load_s / recompute_s)
