from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_KIND_UNSPECIFIED: _ClassVar[CacheKind]
    CACHE_KIND_RETRIEVAL: _ClassVar[CacheKind]
    CACHE_KIND_TOOL: _ClassVar[CacheKind]
CACHE_KIND_UNSPECIFIED: CacheKind
CACHE_KIND_RETRIEVAL: CacheKind
CACHE_KIND_TOOL: CacheKind

class CacheGetRequest(_message.Message):
    __slots__ = ("kind", "key")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    key: str
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., key: _Optional[str] = ...) -> None: ...

class CacheGetResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class CachePutRequest(_message.Message):
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

class CachePutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
