from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OnBadQuery(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_BAD_QUERY_UNSPECIFIED: _ClassVar[OnBadQuery]
    ON_BAD_QUERY_REJECT: _ClassVar[OnBadQuery]
    ON_BAD_QUERY_FAIL_ROW: _ClassVar[OnBadQuery]

class BatchStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_STATUS_UNSPECIFIED: _ClassVar[BatchStatus]
    VALIDATING: _ClassVar[BatchStatus]
    IN_PROGRESS: _ClassVar[BatchStatus]
    COMPLETED: _ClassVar[BatchStatus]
    FAILED: _ClassVar[BatchStatus]
    CANCELLING: _ClassVar[BatchStatus]
    CANCELLED: _ClassVar[BatchStatus]
    EXPIRING: _ClassVar[BatchStatus]
    EXPIRED: _ClassVar[BatchStatus]
ON_BAD_QUERY_UNSPECIFIED: OnBadQuery
ON_BAD_QUERY_REJECT: OnBadQuery
ON_BAD_QUERY_FAIL_ROW: OnBadQuery
BATCH_STATUS_UNSPECIFIED: BatchStatus
VALIDATING: BatchStatus
IN_PROGRESS: BatchStatus
COMPLETED: BatchStatus
FAILED: BatchStatus
CANCELLING: BatchStatus
CANCELLED: BatchStatus
EXPIRING: BatchStatus
EXPIRED: BatchStatus

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Query(_message.Message):
    __slots__ = ("id", "prompt", "max_tokens", "sampling", "forced_length", "metadata", "openai_body")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FORCED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    OPENAI_BODY_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    max_tokens: int
    sampling: SamplingParams
    forced_length: int
    metadata: _containers.ScalarMap[str, str]
    openai_body: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., forced_length: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., openai_body: _Optional[str] = ...) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("queries", "metadata", "batch_id", "on_bad_query", "completion_window", "priority", "end_of_batch")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ON_BAD_QUERY_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    END_OF_BATCH_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[Query]
    metadata: _containers.ScalarMap[str, str]
    batch_id: str
    on_bad_query: OnBadQuery
    completion_window: str
    priority: int
    end_of_batch: bool
    def __init__(self, queries: _Optional[_Iterable[_Union[Query, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., batch_id: _Optional[str] = ..., on_bad_query: _Optional[_Union[OnBadQuery, str]] = ..., completion_window: _Optional[str] = ..., priority: _Optional[int] = ..., end_of_batch: _Optional[bool] = ...) -> None: ...

class RequestCounts(_message.Message):
    __slots__ = ("total", "completed", "failed", "cancelled")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    total: int
    completed: int
    failed: int
    cancelled: int
    def __init__(self, total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., cancelled: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "status", "request_counts", "created_at", "completed_at", "metadata", "queries_per_cluster", "predicted_tokens_per_cluster", "policy", "deadline", "completion_window", "priority", "predicted_finish_at", "at_risk", "predicted_tokens", "done_predicted_tokens", "done_actual_tokens", "remaining_tokens", "cost_dollars")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class QueriesPerClusterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PredictedTokensPerClusterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    QUERIES_PER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_PER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FINISH_AT_FIELD_NUMBER: _ClassVar[int]
    AT_RISK_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_ACTUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_DOLLARS_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: BatchStatus
    request_counts: RequestCounts
    created_at: float
    completed_at: float
    metadata: _containers.ScalarMap[str, str]
    queries_per_cluster: _containers.ScalarMap[str, int]
    predicted_tokens_per_cluster: _containers.ScalarMap[str, float]
    policy: str
    deadline: float
    completion_window: str
    priority: int
    predicted_finish_at: float
    at_risk: bool
    predicted_tokens: float
    done_predicted_tokens: float
    done_actual_tokens: int
    remaining_tokens: float
    cost_dollars: float
    def __init__(self, id: _Optional[str] = ..., status: _Optional[_Union[BatchStatus, str]] = ..., request_counts: _Optional[_Union[RequestCounts, _Mapping]] = ..., created_at: _Optional[float] = ..., completed_at: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ..., queries_per_cluster: _Optional[_Mapping[str, int]] = ..., predicted_tokens_per_cluster: _Optional[_Mapping[str, float]] = ..., policy: _Optional[str] = ..., deadline: _Optional[float] = ..., completion_window: _Optional[str] = ..., priority: _Optional[int] = ..., predicted_finish_at: _Optional[float] = ..., at_risk: _Optional[bool] = ..., predicted_tokens: _Optional[float] = ..., done_predicted_tokens: _Optional[float] = ..., done_actual_tokens: _Optional[int] = ..., remaining_tokens: _Optional[float] = ..., cost_dollars: _Optional[float] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class CancelBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class StreamResultsRequest(_message.Message):
    __slots__ = ("batch_id", "follow", "start_index")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    follow: bool
    start_index: int
    def __init__(self, batch_id: _Optional[str] = ..., follow: _Optional[bool] = ..., start_index: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("enqueued_at", "started_at", "first_token_at", "finished_at")
    ENQUEUED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    enqueued_at: float
    started_at: float
    first_token_at: float
    finished_at: float
    def __init__(self, enqueued_at: _Optional[float] = ..., started_at: _Optional[float] = ..., first_token_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class QueryResult(_message.Message):
    __slots__ = ("batch_id", "query_id", "text", "prompt_tokens", "completion_tokens", "cluster", "timings", "finish_reason", "error", "predicted_tokens", "index", "attempts", "openai_extra")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    OPENAI_EXTRA_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    query_id: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    cluster: str
    timings: Timings
    finish_reason: str
    error: str
    predicted_tokens: float
    index: int
    attempts: int
    openai_extra: str
    def __init__(self, batch_id: _Optional[str] = ..., query_id: _Optional[str] = ..., text: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cluster: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., predicted_tokens: _Optional[float] = ..., index: _Optional[int] = ..., attempts: _Optional[int] = ..., openai_extra: _Optional[str] = ...) -> None: ...

class ListClustersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("name", "alive", "state", "capacity_tokens_per_s", "plan_tokens_per_s", "measured_tokens_per_s", "queue_length", "running", "waiting", "kv_used_tokens", "kv_free_tokens", "pending_predicted_tokens", "expected_finish_s", "last_heartbeat", "backend", "inflight", "assigned_predicted_tokens", "finished_predicted_tokens", "finished_actual_tokens", "finished_queries", "price_per_hour", "billed", "cost_dollars")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FINISH_S_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_ACTUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    BILLED_FIELD_NUMBER: _ClassVar[int]
    COST_DOLLARS_FIELD_NUMBER: _ClassVar[int]
    name: str
    alive: bool
    state: str
    capacity_tokens_per_s: float
    plan_tokens_per_s: float
    measured_tokens_per_s: float
    queue_length: int
    running: int
    waiting: int
    kv_used_tokens: int
    kv_free_tokens: int
    pending_predicted_tokens: float
    expected_finish_s: float
    last_heartbeat: float
    backend: str
    inflight: int
    assigned_predicted_tokens: float
    finished_predicted_tokens: float
    finished_actual_tokens: int
    finished_queries: int
    price_per_hour: float
    billed: bool
    cost_dollars: float
    def __init__(self, name: _Optional[str] = ..., alive: _Optional[bool] = ..., state: _Optional[str] = ..., capacity_tokens_per_s: _Optional[float] = ..., plan_tokens_per_s: _Optional[float] = ..., measured_tokens_per_s: _Optional[float] = ..., queue_length: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., pending_predicted_tokens: _Optional[float] = ..., expected_finish_s: _Optional[float] = ..., last_heartbeat: _Optional[float] = ..., backend: _Optional[str] = ..., inflight: _Optional[int] = ..., assigned_predicted_tokens: _Optional[float] = ..., finished_predicted_tokens: _Optional[float] = ..., finished_actual_tokens: _Optional[int] = ..., finished_queries: _Optional[int] = ..., price_per_hour: _Optional[float] = ..., billed: _Optional[bool] = ..., cost_dollars: _Optional[float] = ...) -> None: ...

class ListClustersResponse(_message.Message):
    __slots__ = ("clusters", "cost_per_hour", "cost_dollars")
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    COST_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    COST_DOLLARS_FIELD_NUMBER: _ClassVar[int]
    clusters: _containers.RepeatedCompositeFieldContainer[ClusterStatus]
    cost_per_hour: float
    cost_dollars: float
    def __init__(self, clusters: _Optional[_Iterable[_Union[ClusterStatus, _Mapping]]] = ..., cost_per_hour: _Optional[float] = ..., cost_dollars: _Optional[float] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("src", "dst", "count", "predicted_tokens", "moved")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    count: int
    predicted_tokens: float
    moved: int
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., count: _Optional[int] = ..., predicted_tokens: _Optional[float] = ..., moved: _Optional[int] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("dry_run", "drain")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    drain: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dry_run: _Optional[bool] = ..., drain: _Optional[_Iterable[str]] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("moves", "applied", "before", "after", "message")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    applied: bool
    before: _containers.RepeatedCompositeFieldContainer[ClusterStatus]
    after: _containers.RepeatedCompositeFieldContainer[ClusterStatus]
    message: str
    def __init__(self, moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., applied: _Optional[bool] = ..., before: _Optional[_Iterable[_Union[ClusterStatus, _Mapping]]] = ..., after: _Optional[_Iterable[_Union[ClusterStatus, _Mapping]]] = ..., message: _Optional[str] = ...) -> None: ...

class DrainClusterRequest(_message.Message):
    __slots__ = ("name", "dry_run", "preempt", "notice_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    NOTICE_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    dry_run: bool
    preempt: bool
    notice_s: float
    def __init__(self, name: _Optional[str] = ..., dry_run: _Optional[bool] = ..., preempt: _Optional[bool] = ..., notice_s: _Optional[float] = ...) -> None: ...

class AddClusterRequest(_message.Message):
    __slots__ = ("name", "capacity_tokens_per_s", "backend", "max_query_tokens", "kv_budget_tokens", "update")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_tokens_per_s: float
    backend: str
    max_query_tokens: int
    kv_budget_tokens: int
    update: bool
    def __init__(self, name: _Optional[str] = ..., capacity_tokens_per_s: _Optional[float] = ..., backend: _Optional[str] = ..., max_query_tokens: _Optional[int] = ..., kv_budget_tokens: _Optional[int] = ..., update: _Optional[bool] = ...) -> None: ...

class RemoveClusterRequest(_message.Message):
    __slots__ = ("name", "force", "dry_run")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    dry_run: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ..., dry_run: _Optional[bool] = ...) -> None: ...
