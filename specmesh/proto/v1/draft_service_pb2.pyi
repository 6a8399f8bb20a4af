from specmesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSequence(_message.Message):
    __slots__ = ("sequence_id", "new_token_ids", "method", "max_depth", "max_nodes", "tenant_salt", "traceparent", "temperature", "top_k", "top_p", "seed", "has_seed", "features")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    method: _common_pb2.SpeculationMethod
    max_depth: int
    max_nodes: int
    tenant_salt: str
    traceparent: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    has_seed: bool
    features: FeatureRows
    def __init__(self, sequence_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., method: _Optional[_Union[_common_pb2.SpeculationMethod, str]] = ..., max_depth: _Optional[int] = ..., max_nodes: _Optional[int] = ..., tenant_salt: _Optional[str] = ..., traceparent: _Optional[str] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., features: _Optional[_Union[FeatureRows, _Mapping]] = ...) -> None: ...

class FeatureRows(_message.Message):
    __slots__ = ("start", "num_rows", "hidden_size", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    num_rows: int
    hidden_size: int
    data: bytes
    def __init__(self, start: _Optional[int] = ..., num_rows: _Optional[int] = ..., hidden_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sequences", "step")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[DraftSequence]
    step: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[DraftSequence, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "parents", "distributions")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    def __init__(self, sequence_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("trees", "step")
    TREES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[DraftTree]
    step: int
    def __init__(self, trees: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class ProposeStreamRequest(_message.Message):
    __slots__ = ("sequences", "step")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[DraftSequence]
    step: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[DraftSequence, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class ProposeStreamResponse(_message.Message):
    __slots__ = ("trees", "step")
    TREES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[DraftTree]
    step: int
    def __init__(self, trees: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("sequence_ids",)
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "unknown")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    released: int
    unknown: int
    def __init__(self, released: _Optional[int] = ..., unknown: _Optional[int] = ...) -> None: ...
