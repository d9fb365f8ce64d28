from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "draft_logprobs", "expanded", "proposals", "sources")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXPANDED_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_logprobs: _containers.RepeatedScalarFieldContainer[float]
    expanded: _containers.RepeatedScalarFieldContainer[bool]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    sources: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_logprobs: _Optional[_Iterable[float]] = ..., expanded: _Optional[_Iterable[bool]] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., sources: _Optional[_Iterable[int]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("parent", "token_ids", "probs")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    parent: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, parent: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class TreeSpec(_message.Message):
    __slots__ = ("gamma", "top_k_spec", "top_head", "tree_type", "gamma_threshold")
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    TOP_K_SPEC_FIELD_NUMBER: _ClassVar[int]
    TOP_HEAD_FIELD_NUMBER: _ClassVar[int]
    TREE_TYPE_FIELD_NUMBER: _ClassVar[int]
    GAMMA_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    gamma: int
    top_k_spec: _containers.RepeatedCompositeFieldContainer[TopKRow]
    top_head: _containers.RepeatedScalarFieldContainer[int]
    tree_type: int
    gamma_threshold: float
    def __init__(self, gamma: _Optional[int] = ..., top_k_spec: _Optional[_Iterable[_Union[TopKRow, _Mapping]]] = ..., top_head: _Optional[_Iterable[int]] = ..., tree_type: _Optional[int] = ..., gamma_threshold: _Optional[float] = ...) -> None: ...

class TopKRow(_message.Message):
    __slots__ = ("k",)
    K_FIELD_NUMBER: _ClassVar[int]
    k: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
