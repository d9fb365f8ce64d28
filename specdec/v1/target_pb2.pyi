from specdec.v1 import tree_pb2 as _tree_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _tree_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_tree_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cached_tokens", "prompt_logprobs")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_tree_pb2.TokenLogprobs]
    def __init__(self, cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_tree_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _tree_pb2.TokenTree
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_tree_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_nodes", "tokens", "verify_ms", "batch_size", "batch_rows", "mergeable_sessions", "service_ms", "logprobs")
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MERGEABLE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    verify_ms: float
    batch_size: int
    batch_rows: int
    mergeable_sessions: int
    service_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_tree_pb2.TokenLogprobs]
    def __init__(self, accepted_nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., verify_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_rows: _Optional[int] = ..., mergeable_sessions: _Optional[int] = ..., service_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_tree_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResponse, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "num_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "context_limit", "eos_token_ids", "sessions", "cached_tokens", "tensor_parallel", "batched_forwards", "max_tree_nodes", "max_kv_tokens", "host", "device", "cpus")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    context_limit: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sessions: int
    cached_tokens: int
    tensor_parallel: int
    batched_forwards: int
    max_tree_nodes: int
    max_kv_tokens: int
    host: str
    device: str
    cpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_limit: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., batched_forwards: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_kv_tokens: _Optional[int] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ...) -> None: ...
