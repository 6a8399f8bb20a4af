"""ListModels: the router's pools and each replica's last polled health, KV and queue."""

from __future__ import annotations

from specmesh.proto.v1 import router_service_pb2


def list_models(pools) -> router_service_pb2.ListModelsResponse:
    """`pools`: name -> services.router.pools.Pool (the router's routing table)."""
    return router_service_pb2.ListModelsResponse(pools=[_pool(p) for p in pools.values()])


def _pool(pool) -> router_service_pb2.ModelPool:
    return router_service_pb2.ModelPool(
        name=pool.name, model=pool.config.model, max_context=pool.config.max_context,
        replicas=[_replica(r) for r in pool.replicas.replicas])


def _replica(replica) -> router_service_pb2.ReplicaStatus:
    status = router_service_pb2.ReplicaStatus(address=replica.address, healthy=replica.healthy,
                                              in_flight=replica.in_flight)
    s = replica.stats
    if s is not None:
        status.has_stats = True
        status.running_requests, status.waiting_requests = s.running, s.waiting
        status.queued_tokens, status.num_blocks = s.queued_tokens, s.num_blocks
        status.free_blocks, status.cached_blocks = s.free_blocks, s.cached_blocks
        status.host_tier_bytes, status.host_tier_capacity_bytes = s.host_tier_bytes, s.host_tier_capacity_bytes
        status.host_tier_restored_blocks = s.host_tier_restored_blocks
        status.shared_tier_bytes, status.shared_tier_capacity_bytes = s.shared_tier_bytes, s.shared_tier_capacity_bytes
        status.shared_tier_restored_blocks = s.shared_tier_restored_blocks
        status.kv_cold_precision_setting, status.kv_cold_precision = s.cold_setting, s.cold_precision
        status.kv_cold_precision_reason = s.cold_reason
        status.host_tier_fp8_blocks, status.host_tier_fp8_bytes = s.host_tier_cold_blocks, s.host_tier_cold_bytes
    return status
