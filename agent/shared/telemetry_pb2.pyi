from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_STAGE_UNSPECIFIED: _ClassVar[CheckpointStage]
    SAVE_START: _ClassVar[CheckpointStage]
    STAGED: _ClassVar[CheckpointStage]
    COMMITTED: _ClassVar[CheckpointStage]
    RESTORE_START: _ClassVar[CheckpointStage]
    RESTORED: _ClassVar[CheckpointStage]
    FAILED: _ClassVar[CheckpointStage]
    SET_ASIDE: _ClassVar[CheckpointStage]
    HELD: _ClassVar[CheckpointStage]
    RESUME_BLOCKED: _ClassVar[CheckpointStage]
    SNAPSHOT: _ClassVar[CheckpointStage]
    WRITTEN: _ClassVar[CheckpointStage]
CHECKPOINT_STAGE_UNSPECIFIED: CheckpointStage
SAVE_START: CheckpointStage
STAGED: CheckpointStage
COMMITTED: CheckpointStage
RESTORE_START: CheckpointStage
RESTORED: CheckpointStage
FAILED: CheckpointStage
SET_ASIDE: CheckpointStage
HELD: CheckpointStage
RESUME_BLOCKED: CheckpointStage
SNAPSHOT: CheckpointStage
WRITTEN: CheckpointStage

class Hello(_message.Message):
    __slots__ = ("job", "rank", "local_rank", "world_size", "mesh", "pid", "restart_count", "hostname", "peer_token", "step_source", "gpu_uuid")
    class MeshEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    local_rank: int
    world_size: int
    mesh: _containers.ScalarMap[str, int]
    pid: int
    restart_count: int
    hostname: str
    peer_token: str
    step_source: str
    gpu_uuid: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., mesh: _Optional[_Mapping[str, int]] = ..., pid: _Optional[int] = ..., restart_count: _Optional[int] = ..., hostname: _Optional[str] = ..., peer_token: _Optional[str] = ..., step_source: _Optional[str] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("index", "start_unix", "duration_seconds", "tokens", "phases")
    class PhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    index: int
    start_unix: float
    duration_seconds: float
    tokens: int
    phases: _containers.ScalarMap[str, float]
    def __init__(self, index: _Optional[int] = ..., start_unix: _Optional[float] = ..., duration_seconds: _Optional[float] = ..., tokens: _Optional[int] = ..., phases: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Steps(_message.Message):
    __slots__ = ("steps", "next_within_seconds")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_WITHIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[Step]
    next_within_seconds: float
    def __init__(self, steps: _Optional[_Iterable[_Union[Step, _Mapping]]] = ..., next_within_seconds: _Optional[float] = ...) -> None: ...

class CollectiveSummary(_message.Message):
    __slots__ = ("process_group", "op", "count", "wait_seconds", "last_seq_id")
    PROCESS_GROUP_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    process_group: str
    op: str
    count: int
    wait_seconds: float
    last_seq_id: int
    def __init__(self, process_group: _Optional[str] = ..., op: _Optional[str] = ..., count: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., last_seq_id: _Optional[int] = ...) -> None: ...

class GroupMembers(_message.Message):
    __slots__ = ("name", "ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Arrivals(_message.Message):
    __slots__ = ("groups", "group", "seq", "enqueued_ns", "continues", "members", "ops", "op")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_NS_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[str]
    group: _containers.RepeatedScalarFieldContainer[int]
    seq: _containers.RepeatedScalarFieldContainer[int]
    enqueued_ns: _containers.RepeatedScalarFieldContainer[int]
    continues: bool
    members: _containers.RepeatedCompositeFieldContainer[GroupMembers]
    ops: _containers.RepeatedScalarFieldContainer[str]
    op: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, groups: _Optional[_Iterable[str]] = ..., group: _Optional[_Iterable[int]] = ..., seq: _Optional[_Iterable[int]] = ..., enqueued_ns: _Optional[_Iterable[int]] = ..., continues: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[GroupMembers, _Mapping]]] = ..., ops: _Optional[_Iterable[str]] = ..., op: _Optional[_Iterable[int]] = ...) -> None: ...

class Collectives(_message.Message):
    __slots__ = ("ops", "has_durations", "entries_missed", "arrivals")
    OPS_FIELD_NUMBER: _ClassVar[int]
    HAS_DURATIONS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_MISSED_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[CollectiveSummary]
    has_durations: bool
    entries_missed: int
    arrivals: Arrivals
    def __init__(self, ops: _Optional[_Iterable[_Union[CollectiveSummary, _Mapping]]] = ..., has_durations: _Optional[bool] = ..., entries_missed: _Optional[int] = ..., arrivals: _Optional[_Union[Arrivals, _Mapping]] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("stage", "step", "seconds", "bytes", "path", "detail")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    stage: CheckpointStage
    step: int
    seconds: float
    bytes: int
    path: str
    detail: str
    def __init__(self, stage: _Optional[_Union[CheckpointStage, str]] = ..., step: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., path: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ClientStats(_message.Message):
    __slots__ = ("dropped", "reconnects")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    reconnects: int
    def __init__(self, dropped: _Optional[int] = ..., reconnects: _Optional[int] = ...) -> None: ...

class TrainingThread(_message.Message):
    __slots__ = ("still_seconds", "collective_pending_seconds")
    STILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_PENDING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    still_seconds: float
    collective_pending_seconds: float
    def __init__(self, still_seconds: _Optional[float] = ..., collective_pending_seconds: _Optional[float] = ...) -> None: ...

class Numeric(_message.Message):
    __slots__ = ("kind", "step", "first_rank", "action", "detail")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    step: int
    first_rank: int
    action: str
    detail: str
    def __init__(self, kind: _Optional[str] = ..., step: _Optional[int] = ..., first_rank: _Optional[int] = ..., action: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "step", "collectives", "checkpoint", "goodbye", "stats", "steps", "training_thread", "numeric")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_THREAD_FIELD_NUMBER: _ClassVar[int]
    NUMERIC_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    step: Step
    collectives: Collectives
    checkpoint: Checkpoint
    goodbye: Goodbye
    stats: ClientStats
    steps: Steps
    training_thread: TrainingThread
    numeric: Numeric
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., collectives: _Optional[_Union[Collectives, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., stats: _Optional[_Union[ClientStats, _Mapping]] = ..., steps: _Optional[_Union[Steps, _Mapping]] = ..., training_thread: _Optional[_Union[TrainingThread, _Mapping]] = ..., numeric: _Optional[_Union[Numeric, _Mapping]] = ...) -> None: ...

class DumpDiagnostics(_message.Message):
    __slots__ = ("dir",)
    DIR_FIELD_NUMBER: _ClassVar[int]
    dir: str
    def __init__(self, dir: _Optional[str] = ...) -> None: ...

class CheckpointNow(_message.Message):
    __slots__ = ("step", "hold")
    STEP_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    step: int
    hold: bool
    def __init__(self, step: _Optional[int] = ..., hold: _Optional[bool] = ...) -> None: ...

class ReadPace(_message.Message):
    __slots__ = ("max_period_seconds", "step_send_seconds")
    MAX_PERIOD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_period_seconds: float
    step_send_seconds: float
    def __init__(self, max_period_seconds: _Optional[float] = ..., step_send_seconds: _Optional[float] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentCommand(_message.Message):
    __slots__ = ("dump_diagnostics", "checkpoint_now", "abort", "read_pace")
    DUMP_DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_NOW_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    READ_PACE_FIELD_NUMBER: _ClassVar[int]
    dump_diagnostics: DumpDiagnostics
    checkpoint_now: CheckpointNow
    abort: Abort
    read_pace: ReadPace
    def __init__(self, dump_diagnostics: _Optional[_Union[DumpDiagnostics, _Mapping]] = ..., checkpoint_now: _Optional[_Union[CheckpointNow, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., read_pace: _Optional[_Union[ReadPace, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "local_rank", "pid", "hostname", "connected", "last_step", "last_seen_seconds_ago", "step_p50_seconds", "step_p99_seconds", "wait_share", "tokens_per_second", "restart_count", "flags", "straggler_score")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    STEP_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SHARE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_SCORE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pid: int
    hostname: str
    connected: bool
    last_step: int
    last_seen_seconds_ago: float
    step_p50_seconds: float
    step_p99_seconds: float
    wait_share: float
    tokens_per_second: float
    restart_count: int
    flags: _containers.RepeatedScalarFieldContainer[str]
    straggler_score: float
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ..., connected: _Optional[bool] = ..., last_step: _Optional[int] = ..., last_seen_seconds_ago: _Optional[float] = ..., step_p50_seconds: _Optional[float] = ..., step_p99_seconds: _Optional[float] = ..., wait_share: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., restart_count: _Optional[int] = ..., flags: _Optional[_Iterable[str]] = ..., straggler_score: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "world_size", "mesh", "last_step", "step_p50_seconds", "step_p99_seconds", "tokens_per_second", "checkpoint_last_step", "ranks", "flags", "steps_from")
    class MeshEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FROM_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    mesh: _containers.ScalarMap[str, int]
    last_step: int
    step_p50_seconds: float
    step_p99_seconds: float
    tokens_per_second: float
    checkpoint_last_step: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    flags: _containers.RepeatedScalarFieldContainer[str]
    steps_from: str
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., mesh: _Optional[_Mapping[str, int]] = ..., last_step: _Optional[int] = ..., step_p50_seconds: _Optional[float] = ..., step_p99_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., checkpoint_last_step: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., flags: _Optional[_Iterable[str]] = ..., steps_from: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node", "jobs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    node: str
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, node: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("job", "rank", "step", "path", "bytes", "peer_token")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    path: str
    bytes: int
    peer_token: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., peer_token: _Optional[str] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("allowed", "reason")
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    allowed: bool
    reason: str
    def __init__(self, allowed: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckpointRecordRequest(_message.Message):
    __slots__ = ("job", "world_size", "rank", "all_memory")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    rank: int
    all_memory: bool
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., all_memory: _Optional[bool] = ...) -> None: ...

class MemoryFile(_message.Message):
    __slots__ = ("world_size", "rank", "step")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    rank: int
    step: int
    def __init__(self, world_size: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointRecordReply(_message.Message):
    __slots__ = ("known", "found", "step", "path", "source", "memory_steps", "memory_held")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HELD_FIELD_NUMBER: _ClassVar[int]
    known: bool
    found: bool
    step: int
    path: str
    source: str
    memory_steps: _containers.RepeatedScalarFieldContainer[int]
    memory_held: _containers.RepeatedCompositeFieldContainer[MemoryFile]
    def __init__(self, known: _Optional[bool] = ..., found: _Optional[bool] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., source: _Optional[str] = ..., memory_steps: _Optional[_Iterable[int]] = ..., memory_held: _Optional[_Iterable[_Union[MemoryFile, _Mapping]]] = ...) -> None: ...
