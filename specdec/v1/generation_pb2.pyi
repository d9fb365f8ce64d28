from specdec.v1 import tree_pb2 as _tree_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_ids", "raw", "max_new_tokens", "stop", "sampling", "tree", "no_spec", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    NO_SPEC_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    raw: bool
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    sampling: _tree_pb2.SamplingParams
    tree: _tree_pb2.TreeSpec
    no_spec: bool
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., raw: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., sampling: _Optional[_Union[_tree_pb2.SamplingParams, _Mapping]] = ..., tree: _Optional[_Union[_tree_pb2.TreeSpec, _Mapping]] = ..., no_spec: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "stats", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    stats: FinalStats
    logprobs: _containers.RepeatedCompositeFieldContainer[_tree_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_tree_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., stats: _Optional[_Union[FinalStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_tree_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_tree_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class FinalStats(_message.Message):
    __slots__ = ("new_tokens", "prompt_tokens", "rounds", "acceptance_rate", "mean_accepted_length", "ttft_ms", "total_s", "stop_reason", "fallback_rounds", "final_gamma", "proposed_tokens", "accepted_tokens", "cost_plain_rounds", "drafted_tokens", "context_proposed_tokens", "context_accepted_tokens", "expected_accepted_tokens", "failovers", "pipeline_ahead_hits", "pipeline_ahead_misses", "position_proposed", "position_accepted", "draft_s", "verify_s", "draft_rounds", "draft_link_rtt_ms", "target_link_rtt_ms", "predraft_hits", "pipelined_rounds", "predrafted_rounds", "ahead_hit_rate", "in_line_share", "pipelined_share", "predrafted_share")
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_GAMMA_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_PLAIN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    POSITION_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    POSITION_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LINK_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LINK_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    IN_LINE_SHARE_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_SHARE_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    new_tokens: int
    prompt_tokens: int
    rounds: int
    acceptance_rate: float
    mean_accepted_length: float
    ttft_ms: float
    total_s: float
    stop_reason: str
    fallback_rounds: int
    final_gamma: int
    proposed_tokens: int
    accepted_tokens: int
    cost_plain_rounds: int
    drafted_tokens: int
    context_proposed_tokens: int
    context_accepted_tokens: int
    expected_accepted_tokens: float
    failovers: int
    pipeline_ahead_hits: int
    pipeline_ahead_misses: int
    position_proposed: _containers.RepeatedScalarFieldContainer[int]
    position_accepted: _containers.RepeatedScalarFieldContainer[int]
    draft_s: float
    verify_s: float
    draft_rounds: int
    draft_link_rtt_ms: float
    target_link_rtt_ms: float
    predraft_hits: int
    pipelined_rounds: int
    predrafted_rounds: int
    ahead_hit_rate: float
    in_line_share: float
    pipelined_share: float
    predrafted_share: float
    def __init__(self, new_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_s: _Optional[float] = ..., stop_reason: _Optional[str] = ..., fallback_rounds: _Optional[int] = ..., final_gamma: _Optional[int] = ..., proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., cost_plain_rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., context_proposed_tokens: _Optional[int] = ..., context_accepted_tokens: _Optional[int] = ..., expected_accepted_tokens: _Optional[float] = ..., failovers: _Optional[int] = ..., pipeline_ahead_hits: _Optional[int] = ..., pipeline_ahead_misses: _Optional[int] = ..., position_proposed: _Optional[_Iterable[int]] = ..., position_accepted: _Optional[_Iterable[int]] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., draft_rounds: _Optional[int] = ..., draft_link_rtt_ms: _Optional[float] = ..., target_link_rtt_ms: _Optional[float] = ..., predraft_hits: _Optional[int] = ..., pipelined_rounds: _Optional[int] = ..., predrafted_rounds: _Optional[int] = ..., ahead_hit_rate: _Optional[float] = ..., in_line_share: _Optional[float] = ..., pipelined_share: _Optional[float] = ..., predrafted_share: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...
