from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_KIND_UNSPECIFIED: _ClassVar[CacheKind]
    CACHE_KIND_RETRIEVAL: _ClassVar[CacheKind]
    CACHE_KIND_TOOL: _ClassVar[CacheKind]

class ToolLookupOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_LOOKUP_OUTCOME_UNSPECIFIED: _ClassVar[ToolLookupOutcome]
    TOOL_LOOKUP_OUTCOME_HIT: _ClassVar[ToolLookupOutcome]
    TOOL_LOOKUP_OUTCOME_LEASE_GRANTED: _ClassVar[ToolLookupOutcome]
    TOOL_LOOKUP_OUTCOME_WAITED: _ClassVar[ToolLookupOutcome]
CACHE_KIND_UNSPECIFIED: CacheKind
CACHE_KIND_RETRIEVAL: CacheKind
CACHE_KIND_TOOL: CacheKind
TOOL_LOOKUP_OUTCOME_UNSPECIFIED: ToolLookupOutcome
TOOL_LOOKUP_OUTCOME_HIT: ToolLookupOutcome
TOOL_LOOKUP_OUTCOME_LEASE_GRANTED: ToolLookupOutcome
TOOL_LOOKUP_OUTCOME_WAITED: ToolLookupOutcome

class CacheServiceGetRequest(_message.Message):
    __slots__ = ("kind", "key")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    key: str
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., key: _Optional[str] = ...) -> None: ...

class CacheServiceGetResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class CacheServicePutRequest(_message.Message):
    __slots__ = ("kind", "key", "value", "ttl_seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    key: str
    value: bytes
    ttl_seconds: int
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class CacheServicePutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheServiceGetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheServiceGetStatsResponse(_message.Message):
    __slots__ = ("replicas", "synced_replicas", "index_entries", "events_applied", "resyncs", "backend")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    INDEX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    synced_replicas: int
    index_entries: int
    events_applied: int
    resyncs: int
    backend: str
    def __init__(self, replicas: _Optional[int] = ..., synced_replicas: _Optional[int] = ..., index_entries: _Optional[int] = ..., events_applied: _Optional[int] = ..., resyncs: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class PrefixMatchRequest(_message.Message):
    __slots__ = ("block_hashes", "replicas")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaPrefixMatch(_message.Message):
    __slots__ = ("replica", "matched_blocks", "synced", "host_blocks", "shared_blocks")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    matched_blocks: int
    synced: bool
    host_blocks: int
    shared_blocks: int
    def __init__(self, replica: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., synced: _Optional[bool] = ..., host_blocks: _Optional[int] = ..., shared_blocks: _Optional[int] = ...) -> None: ...

class PrefixMatchResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[ReplicaPrefixMatch]
    def __init__(self, matches: _Optional[_Iterable[_Union[ReplicaPrefixMatch, _Mapping]]] = ...) -> None: ...

class ToolLookupRequest(_message.Message):
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

class ToolLookupResponse(_message.Message):
    __slots__ = ("outcome", "value", "is_error", "error_message", "lease_id")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    outcome: ToolLookupOutcome
    value: bytes
    is_error: bool
    error_message: str
    lease_id: str
    def __init__(self, outcome: _Optional[_Union[ToolLookupOutcome, str]] = ..., value: _Optional[bytes] = ..., is_error: _Optional[bool] = ..., error_message: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ToolStoreRequest(_message.Message):
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

class ToolStoreResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "text", "version", "labels")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    version: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., version: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ...) -> None: ...

class IngestRequest(_message.Message):
    __slots__ = ("corpus", "documents")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    documents: _containers.RepeatedCompositeFieldContainer[Document]
    def __init__(self, corpus: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[Document, _Mapping]]] = ...) -> None: ...

class IngestResponse(_message.Message):
    __slots__ = ("corpus_version", "num_documents")
    CORPUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    corpus_version: int
    num_documents: int
    def __init__(self, corpus_version: _Optional[int] = ..., num_documents: _Optional[int] = ...) -> None: ...

class DeleteDocumentsRequest(_message.Message):
    __slots__ = ("corpus", "ids")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, corpus: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteDocumentsResponse(_message.Message):
    __slots__ = ("corpus_version", "deleted")
    CORPUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    corpus_version: int
    deleted: int
    def __init__(self, corpus_version: _Optional[int] = ..., deleted: _Optional[int] = ...) -> None: ...

class RetrieveRequest(_message.Message):
    __slots__ = ("corpus", "query", "k")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    corpus: str
    query: str
    k: int
    def __init__(self, corpus: _Optional[str] = ..., query: _Optional[str] = ..., k: _Optional[int] = ...) -> None: ...

class RetrievedDocument(_message.Message):
    __slots__ = ("document", "score")
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    document: Document
    score: float
    def __init__(self, document: _Optional[_Union[Document, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("documents", "cache_hit", "corpus_version")
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    CORPUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[RetrievedDocument]
    cache_hit: bool
    corpus_version: int
    def __init__(self, documents: _Optional[_Iterable[_Union[RetrievedDocument, _Mapping]]] = ..., cache_hit: _Optional[bool] = ..., corpus_version: _Optional[int] = ...) -> None: ...
