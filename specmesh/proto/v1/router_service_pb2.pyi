from specmesh.proto.v1 import cache_service_pb2 as _cache_service_pb2
from specmesh.proto.v1 import common_pb2 as _common_pb2
from specmesh.proto.v1 import tools_pb2 as _tools_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupToolResultRequest(_message.Message):
    __slots__ = ("tool", "tool_version", "arguments_json", "lease_ms")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    TOOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    tool: str
    tool_version: str
    arguments_json: str
    lease_ms: int
    def __init__(self, tool: _Optional[str] = ..., tool_version: _Optional[str] = ..., arguments_json: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LookupToolResultResponse(_message.Message):
    __slots__ = ("outcome", "value", "is_error", "error_message", "lease_id")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    outcome: _cache_service_pb2.ToolLookupOutcome
    value: bytes
    is_error: bool
    error_message: str
    lease_id: str
    def __init__(self, outcome: _Optional[_Union[_cache_service_pb2.ToolLookupOutcome, str]] = ..., value: _Optional[bytes] = ..., is_error: _Optional[bool] = ..., error_message: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class StoreToolResultRequest(_message.Message):
    __slots__ = ("tool", "tool_version", "arguments_json", "lease_id", "value", "error_message", "ttl_seconds")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    TOOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tool: str
    tool_version: str
    arguments_json: str
    lease_id: str
    value: bytes
    error_message: str
    ttl_seconds: int
    def __init__(self, tool: _Optional[str] = ..., tool_version: _Optional[str] = ..., arguments_json: _Optional[str] = ..., lease_id: _Optional[str] = ..., value: _Optional[bytes] = ..., error_message: _Optional[str] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class StoreToolResultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IngestDocumentsRequest(_message.Message):
    __slots__ = ("corpus", "documents")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    documents: _containers.RepeatedCompositeFieldContainer[_cache_service_pb2.Document]
    def __init__(self, corpus: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[_cache_service_pb2.Document, _Mapping]]] = ...) -> None: ...

class IngestDocumentsResponse(_message.Message):
    __slots__ = ("corpus_version", "num_documents")
    CORPUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    corpus_version: int
    num_documents: int
    def __init__(self, corpus_version: _Optional[int] = ..., num_documents: _Optional[int] = ...) -> None: ...

class RemoveDocumentsRequest(_message.Message):
    __slots__ = ("corpus", "ids")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, corpus: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveDocumentsResponse(_message.Message):
    __slots__ = ("corpus_version", "removed")
    CORPUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    corpus_version: int
    removed: int
    def __init__(self, corpus_version: _Optional[int] = ..., removed: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[ModelPool]
    def __init__(self, pools: _Optional[_Iterable[_Union[ModelPool, _Mapping]]] = ...) -> None: ...

class ModelPool(_message.Message):
    __slots__ = ("name", "model", "max_context", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    max_context: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., max_context: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "healthy", "has_stats", "running_requests", "waiting_requests", "queued_tokens", "num_blocks", "free_blocks", "cached_blocks", "in_flight", "host_tier_bytes", "host_tier_capacity_bytes", "host_tier_restored_blocks", "shared_tier_bytes", "shared_tier_capacity_bytes", "shared_tier_restored_blocks", "kv_cold_precision_setting", "kv_cold_precision", "kv_cold_precision_reason", "host_tier_fp8_blocks", "host_tier_fp8_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    HAS_STATS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_COLD_PRECISION_SETTING_FIELD_NUMBER: _ClassVar[int]
    KV_COLD_PRECISION_FIELD_NUMBER: _ClassVar[int]
    KV_COLD_PRECISION_REASON_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FP8_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FP8_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: str
    healthy: bool
    has_stats: bool
    running_requests: int
    waiting_requests: int
    queued_tokens: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    in_flight: int
    host_tier_bytes: int
    host_tier_capacity_bytes: int
    host_tier_restored_blocks: int
    shared_tier_bytes: int
    shared_tier_capacity_bytes: int
    shared_tier_restored_blocks: int
    kv_cold_precision_setting: str
    kv_cold_precision: str
    kv_cold_precision_reason: str
    host_tier_fp8_blocks: int
    host_tier_fp8_bytes: int
    def __init__(self, address: _Optional[str] = ..., healthy: _Optional[bool] = ..., has_stats: _Optional[bool] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., in_flight: _Optional[int] = ..., host_tier_bytes: _Optional[int] = ..., host_tier_capacity_bytes: _Optional[int] = ..., host_tier_restored_blocks: _Optional[int] = ..., shared_tier_bytes: _Optional[int] = ..., shared_tier_capacity_bytes: _Optional[int] = ..., shared_tier_restored_blocks: _Optional[int] = ..., kv_cold_precision_setting: _Optional[str] = ..., kv_cold_precision: _Optional[str] = ..., kv_cold_precision_reason: _Optional[str] = ..., host_tier_fp8_blocks: _Optional[int] = ..., host_tier_fp8_bytes: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "model", "retrieval", "messages", "tools")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    sampling: _common_pb2.SamplingParams
    model: str
    retrieval: RetrievalSpec
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_tools_pb2.Tool]
    def __init__(self, prompt: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., retrieval: _Optional[_Union[RetrievalSpec, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_tools_pb2.Tool, _Mapping]]] = ...) -> None: ...

class RetrievalSpec(_message.Message):
    __slots__ = ("corpus", "query", "k")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    query: str
    k: int
    def __init__(self, corpus: _Optional[str] = ..., query: _Optional[str] = ..., k: _Optional[int] = ...) -> None: ...

class RetrievalReport(_message.Message):
    __slots__ = ("documents", "cache_hit", "corpus_version", "cached_prompt_tokens")
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    CORPUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[RetrievedDocumentRef]
    cache_hit: bool
    corpus_version: int
    cached_prompt_tokens: int
    def __init__(self, documents: _Optional[_Iterable[_Union[RetrievedDocumentRef, _Mapping]]] = ..., cache_hit: _Optional[bool] = ..., corpus_version: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class RetrievedDocumentRef(_message.Message):
    __slots__ = ("id", "version")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    version: int
    def __init__(self, id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "retrieval", "route")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.GenerateChunk
    retrieval: RetrievalReport
    route: RouteRecord
    def __init__(self, chunk: _Optional[_Union[_common_pb2.GenerateChunk, _Mapping]] = ..., retrieval: _Optional[_Union[RetrievalReport, _Mapping]] = ..., route: _Optional[_Union[RouteRecord, _Mapping]] = ...) -> None: ...

class RouteRecord(_message.Message):
    __slots__ = ("bucket", "pool", "replica", "speculation", "escalated", "escalated_from", "reason", "score", "predicted_cached_tokens", "retried", "request_id")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    ESCALATED_FIELD_NUMBER: _ClassVar[int]
    ESCALATED_FROM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRIED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    pool: str
    replica: str
    speculation: _common_pb2.SpeculationPlan
    escalated: bool
    escalated_from: str
    reason: str
    score: RouteScore
    predicted_cached_tokens: int
    retried: bool
    request_id: str
    def __init__(self, bucket: _Optional[str] = ..., pool: _Optional[str] = ..., replica: _Optional[str] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationPlan, _Mapping]] = ..., escalated: _Optional[bool] = ..., escalated_from: _Optional[str] = ..., reason: _Optional[str] = ..., score: _Optional[_Union[RouteScore, _Mapping]] = ..., predicted_cached_tokens: _Optional[int] = ..., retried: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class RouteScore(_message.Message):
    __slots__ = ("cost", "latency_s", "quality", "risk", "total")
    COST_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    cost: float
    latency_s: float
    quality: float
    risk: float
    total: float
    def __init__(self, cost: _Optional[float] = ..., latency_s: _Optional[float] = ..., quality: _Optional[float] = ..., risk: _Optional[float] = ..., total: _Optional[float] = ...) -> None: ...
