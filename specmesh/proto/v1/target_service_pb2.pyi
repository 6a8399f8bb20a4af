from specmesh.proto.v1 import common_pb2 as _common_pb2
from specmesh.proto.v1 import tools_pb2 as _tools_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_BLOCK_STORED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_BLOCK_REMOVED: _ClassVar[KVEventKind]

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KVTier]
    KV_TIER_DEVICE: _ClassVar[KVTier]
    KV_TIER_HOST: _ClassVar[KVTier]
    KV_TIER_SHARED: _ClassVar[KVTier]
KV_EVENT_KIND_UNSPECIFIED: KVEventKind
KV_EVENT_KIND_BLOCK_STORED: KVEventKind
KV_EVENT_KIND_BLOCK_REMOVED: KVEventKind
KV_TIER_UNSPECIFIED: KVTier
KV_TIER_DEVICE: KVTier
KV_TIER_HOST: KVTier
KV_TIER_SHARED: KVTier

class TargetServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "tenant_salt", "speculation", "bucket", "priority", "report_confidence", "messages", "tools")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REPORT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    sampling: _common_pb2.SamplingParams
    tenant_salt: str
    speculation: _common_pb2.SpeculationPlan
    bucket: str
    priority: int
    report_confidence: bool
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_tools_pb2.Tool]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant_salt: _Optional[str] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationPlan, _Mapping]] = ..., bucket: _Optional[str] = ..., priority: _Optional[int] = ..., report_confidence: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_tools_pb2.Tool, _Mapping]]] = ...) -> None: ...

class TargetServiceGenerateResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.GenerateChunk
    def __init__(self, chunk: _Optional[_Union[_common_pb2.GenerateChunk, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_blocks", "free_blocks", "used_blocks", "cached_blocks", "block_size", "running_requests", "waiting_requests", "model", "queued_tokens", "preemptions", "evictions", "prefix_query_tokens", "prefix_hit_tokens", "kv_bytes", "fragmentation", "cache_model_id", "engine_alive", "engine_error", "engine_steps", "host_tier_capacity_bytes", "host_tier_bytes", "host_tier_blocks", "host_tier_stored_blocks", "host_tier_restored_blocks", "host_tier_restored_tokens", "host_tier_dropped_blocks", "host_tier_rejected_blocks", "host_tier_store_seconds", "host_tier_restore_seconds", "shared_tier_capacity_bytes", "shared_tier_bytes", "shared_tier_written_blocks", "shared_tier_deleted_blocks", "shared_tier_dropped_writes", "shared_tier_loaded_blocks", "shared_tier_restored_blocks", "shared_tier_restored_tokens", "shared_tier_rejected_blocks", "shared_tier_errors", "shared_tier_write_seconds", "shared_tier_load_seconds", "recompute_seconds_per_block", "swap_preemptions", "recompute_preemptions", "host_tier_swap_bytes", "host_tier_swapped_out_blocks", "host_tier_swapped_in_blocks", "host_tier_swap_out_seconds", "host_tier_swap_in_seconds", "swap_seconds_per_block", "host_tier_cold_precision", "host_tier_cold_blocks", "host_tier_cold_bytes", "host_tier_cold_stored_blocks", "host_tier_cold_restored_blocks", "host_tier_cold_setting", "host_tier_cold_reason", "host_tier_restore_bytes", "host_tier_cold_swapped_out_blocks", "host_tier_restore_bandwidth", "kv_block_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ALIVE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ERROR_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_STORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_DELETED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SWAP_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_SWAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_SWAPPED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_SWAPPED_IN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_SWAP_OUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_SWAP_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_PRECISION_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_SETTING_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_REASON_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_RESTORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COLD_SWAPPED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_RESTORE_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size: int
    running_requests: int
    waiting_requests: int
    model: str
    queued_tokens: int
    preemptions: int
    evictions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kv_bytes: int
    fragmentation: float
    cache_model_id: str
    engine_alive: bool
    engine_error: str
    engine_steps: int
    host_tier_capacity_bytes: int
    host_tier_bytes: int
    host_tier_blocks: int
    host_tier_stored_blocks: int
    host_tier_restored_blocks: int
    host_tier_restored_tokens: int
    host_tier_dropped_blocks: int
    host_tier_rejected_blocks: int
    host_tier_store_seconds: float
    host_tier_restore_seconds: float
    shared_tier_capacity_bytes: int
    shared_tier_bytes: int
    shared_tier_written_blocks: int
    shared_tier_deleted_blocks: int
    shared_tier_dropped_writes: int
    shared_tier_loaded_blocks: int
    shared_tier_restored_blocks: int
    shared_tier_restored_tokens: int
    shared_tier_rejected_blocks: int
    shared_tier_errors: int
    shared_tier_write_seconds: float
    shared_tier_load_seconds: float
    recompute_seconds_per_block: float
    swap_preemptions: int
    recompute_preemptions: int
    host_tier_swap_bytes: int
    host_tier_swapped_out_blocks: int
    host_tier_swapped_in_blocks: int
    host_tier_swap_out_seconds: float
    host_tier_swap_in_seconds: float
    swap_seconds_per_block: float
    host_tier_cold_precision: str
    host_tier_cold_blocks: int
    host_tier_cold_bytes: int
    host_tier_cold_stored_blocks: int
    host_tier_cold_restored_blocks: int
    host_tier_cold_setting: str
    host_tier_cold_reason: str
    host_tier_restore_bytes: int
    host_tier_cold_swapped_out_blocks: int
    host_tier_restore_bandwidth: float
    kv_block_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., model: _Optional[str] = ..., queued_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., evictions: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., fragmentation: _Optional[float] = ..., cache_model_id: _Optional[str] = ..., engine_alive: _Optional[bool] = ..., engine_error: _Optional[str] = ..., engine_steps: _Optional[int] = ..., host_tier_capacity_bytes: _Optional[int] = ..., host_tier_bytes: _Optional[int] = ..., host_tier_blocks: _Optional[int] = ..., host_tier_stored_blocks: _Optional[int] = ..., host_tier_restored_blocks: _Optional[int] = ..., host_tier_restored_tokens: _Optional[int] = ..., host_tier_dropped_blocks: _Optional[int] = ..., host_tier_rejected_blocks: _Optional[int] = ..., host_tier_store_seconds: _Optional[float] = ..., host_tier_restore_seconds: _Optional[float] = ..., shared_tier_capacity_bytes: _Optional[int] = ..., shared_tier_bytes: _Optional[int] = ..., shared_tier_written_blocks: _Optional[int] = ..., shared_tier_deleted_blocks: _Optional[int] = ..., shared_tier_dropped_writes: _Optional[int] = ..., shared_tier_loaded_blocks: _Optional[int] = ..., shared_tier_restored_blocks: _Optional[int] = ..., shared_tier_restored_tokens: _Optional[int] = ..., shared_tier_rejected_blocks: _Optional[int] = ..., shared_tier_errors: _Optional[int] = ..., shared_tier_write_seconds: _Optional[float] = ..., shared_tier_load_seconds: _Optional[float] = ..., recompute_seconds_per_block: _Optional[float] = ..., swap_preemptions: _Optional[int] = ..., recompute_preemptions: _Optional[int] = ..., host_tier_swap_bytes: _Optional[int] = ..., host_tier_swapped_out_blocks: _Optional[int] = ..., host_tier_swapped_in_blocks: _Optional[int] = ..., host_tier_swap_out_seconds: _Optional[float] = ..., host_tier_swap_in_seconds: _Optional[float] = ..., swap_seconds_per_block: _Optional[float] = ..., host_tier_cold_precision: _Optional[str] = ..., host_tier_cold_blocks: _Optional[int] = ..., host_tier_cold_bytes: _Optional[int] = ..., host_tier_cold_stored_blocks: _Optional[int] = ..., host_tier_cold_restored_blocks: _Optional[int] = ..., host_tier_cold_setting: _Optional[str] = ..., host_tier_cold_reason: _Optional[str] = ..., host_tier_restore_bytes: _Optional[int] = ..., host_tier_cold_swapped_out_blocks: _Optional[int] = ..., host_tier_restore_bandwidth: _Optional[float] = ..., kv_block_bytes: _Optional[int] = ...) -> None: ...

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ("after_sequence", "snapshot")
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    after_sequence: int
    snapshot: bool
    def __init__(self, after_sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence", "kind", "block_hash", "parent_hash", "num_tokens", "scope", "tier")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: KVEventKind
    block_hash: int
    parent_hash: int
    num_tokens: int
    scope: str
    tier: KVTier
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[KVEventKind, str]] = ..., block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., num_tokens: _Optional[int] = ..., scope: _Optional[str] = ..., tier: _Optional[_Union[KVTier, str]] = ...) -> None: ...

class SubscribeKVEventsResponse(_message.Message):
    __slots__ = ("events", "is_snapshot", "snapshot_sequence", "snapshot_blocks")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    IS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    is_snapshot: bool
    snapshot_sequence: int
    snapshot_blocks: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., is_snapshot: _Optional[bool] = ..., snapshot_sequence: _Optional[int] = ..., snapshot_blocks: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
