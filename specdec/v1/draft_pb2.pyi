from specdec.v1 import tree_pb2 as _tree_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("start", "propose", "commit", "ahead", "resolve")
    START_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    RESOLVE_FIELD_NUMBER: _ClassVar[int]
    start: DraftStart
    propose: TreeRequest
    commit: DraftCommit
    ahead: AheadRequest
    resolve: AheadResolve
    def __init__(self, start: _Optional[_Union[DraftStart, _Mapping]] = ..., propose: _Optional[_Union[TreeRequest, _Mapping]] = ..., commit: _Optional[_Union[DraftCommit, _Mapping]] = ..., ahead: _Optional[_Union[AheadRequest, _Mapping]] = ..., resolve: _Optional[_Union[AheadResolve, _Mapping]] = ...) -> None: ...

class DraftStart(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _tree_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_tree_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class TreeRequest(_message.Message):
    __slots__ = ("spec", "max_depth", "round")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    spec: _tree_pb2.TreeSpec
    max_depth: int
    round: int
    def __init__(self, spec: _Optional[_Union[_tree_pb2.TreeSpec, _Mapping]] = ..., max_depth: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class DraftCommit(_message.Message):
    __slots__ = ("tokens", "accepted_nodes")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ...) -> None: ...

class AheadRequest(_message.Message):
    __slots__ = ("path_nodes", "spec", "max_depth", "round", "alternatives", "exclude")
    PATH_NODES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    path_nodes: _containers.RepeatedScalarFieldContainer[int]
    spec: _tree_pb2.TreeSpec
    max_depth: int
    round: int
    alternatives: _containers.RepeatedCompositeFieldContainer[AheadAlternative]
    exclude: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, path_nodes: _Optional[_Iterable[int]] = ..., spec: _Optional[_Union[_tree_pb2.TreeSpec, _Mapping]] = ..., max_depth: _Optional[int] = ..., round: _Optional[int] = ..., alternatives: _Optional[_Iterable[_Union[AheadAlternative, _Mapping]]] = ..., exclude: _Optional[_Iterable[int]] = ...) -> None: ...

class AheadAlternative(_message.Message):
    __slots__ = ("path_nodes", "exclude", "max_depth")
    PATH_NODES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    path_nodes: _containers.RepeatedScalarFieldContainer[int]
    exclude: _containers.RepeatedScalarFieldContainer[int]
    max_depth: int
    def __init__(self, path_nodes: _Optional[_Iterable[int]] = ..., exclude: _Optional[_Iterable[int]] = ..., max_depth: _Optional[int] = ...) -> None: ...

class AheadResolve(_message.Message):
    __slots__ = ("adopt", "candidate")
    ADOPT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    adopt: bool
    candidate: int
    def __init__(self, adopt: _Optional[bool] = ..., candidate: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("started", "tree")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    started: DraftStarted
    tree: DraftTreeReply
    def __init__(self, started: _Optional[_Union[DraftStarted, _Mapping]] = ..., tree: _Optional[_Union[DraftTreeReply, _Mapping]] = ...) -> None: ...

class DraftStarted(_message.Message):
    __slots__ = ("cached_tokens", "context_limit")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    context_limit: int
    def __init__(self, cached_tokens: _Optional[int] = ..., context_limit: _Optional[int] = ...) -> None: ...

class DraftTreeReply(_message.Message):
    __slots__ = ("round", "tree", "draft_ms", "batch_size", "ahead", "guess_token", "forward_ms", "alternatives")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    GUESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    round: int
    tree: _tree_pb2.TokenTree
    draft_ms: float
    batch_size: int
    ahead: bool
    guess_token: int
    forward_ms: float
    alternatives: _containers.RepeatedCompositeFieldContainer[AlternativeTree]
    def __init__(self, round: _Optional[int] = ..., tree: _Optional[_Union[_tree_pb2.TokenTree, _Mapping]] = ..., draft_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., ahead: _Optional[bool] = ..., guess_token: _Optional[int] = ..., forward_ms: _Optional[float] = ..., alternatives: _Optional[_Iterable[_Union[AlternativeTree, _Mapping]]] = ...) -> None: ...

class AlternativeTree(_message.Message):
    __slots__ = ("token", "tree")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    token: int
    tree: _tree_pb2.TokenTree
    def __init__(self, token: _Optional[int] = ..., tree: _Optional[_Union[_tree_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfoResponse(_message.Message):
    __slots__ = ("sessions", "cached_sessions", "context_limit", "cached_tokens", "host", "device", "cpus", "batched_forwards")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    cached_sessions: int
    context_limit: int
    cached_tokens: int
    host: str
    device: str
    cpus: _containers.RepeatedScalarFieldContainer[int]
    batched_forwards: int
    def __init__(self, sessions: _Optional[int] = ..., cached_sessions: _Optional[int] = ..., context_limit: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ..., batched_forwards: _Optional[int] = ...) -> None: ...
