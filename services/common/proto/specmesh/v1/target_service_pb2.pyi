from services.common.proto.specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "tenant_salt", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    sampling: _common_pb2.SamplingParams
    tenant_salt: str
    speculation: _common_pb2.SpeculationPlan
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant_salt: _Optional[str] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationPlan, _Mapping]] = ...) -> None: ...

class TargetGenerateResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.GenerateChunk
    def __init__(self, chunk: _Optional[_Union[_common_pb2.GenerateChunk, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_blocks", "free_blocks", "used_blocks", "cached_blocks", "block_size", "running_requests", "waiting_requests", "model")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size: int
    running_requests: int
    waiting_requests: int
    model: str
    def __init__(self, num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
