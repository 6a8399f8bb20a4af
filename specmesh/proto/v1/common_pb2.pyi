from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]

class SpeculationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_METHOD_UNSPECIFIED: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_OFF: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_PROMPT_LOOKUP: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_SUFFIX: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_DRAFT_MODEL: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_DYNAMIC_TREE: _ClassVar[SpeculationMethod]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
SPECULATION_METHOD_UNSPECIFIED: SpeculationMethod
SPECULATION_METHOD_OFF: SpeculationMethod
SPECULATION_METHOD_PROMPT_LOOKUP: SpeculationMethod
SPECULATION_METHOD_SUFFIX: SpeculationMethod
SPECULATION_METHOD_DRAFT_MODEL: SpeculationMethod
SPECULATION_METHOD_DYNAMIC_TREE: SpeculationMethod

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "has_seed", "stop")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    has_seed: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "proposed_tokens", "accepted_tokens", "rejected_tokens", "acceptance_length", "mean_logprob", "min_logprob", "mean_margin", "verify_passes", "fallback_steps")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    MIN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    MEAN_MARGIN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PASSES_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    proposed_tokens: int
    accepted_tokens: int
    rejected_tokens: int
    acceptance_length: float
    mean_logprob: float
    min_logprob: float
    mean_margin: float
    verify_passes: int
    fallback_steps: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., rejected_tokens: _Optional[int] = ..., acceptance_length: _Optional[float] = ..., mean_logprob: _Optional[float] = ..., min_logprob: _Optional[float] = ..., mean_margin: _Optional[float] = ..., verify_passes: _Optional[int] = ..., fallback_steps: _Optional[int] = ...) -> None: ...

class SpeculationPlan(_message.Message):
    __slots__ = ("method", "max_depth", "max_nodes", "load_aware", "acceptance_prior")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    LOAD_AWARE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PRIOR_FIELD_NUMBER: _ClassVar[int]
    method: SpeculationMethod
    max_depth: int
    max_nodes: int
    load_aware: bool
    acceptance_prior: float
    def __init__(self, method: _Optional[_Union[SpeculationMethod, str]] = ..., max_depth: _Optional[int] = ..., max_nodes: _Optional[int] = ..., load_aware: _Optional[bool] = ..., acceptance_prior: _Optional[float] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...
