from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_STATE_UNSPECIFIED: _ClassVar[ServerState]
    SERVER_STATE_STARTING: _ClassVar[ServerState]
    SERVER_STATE_SERVING: _ClassVar[ServerState]
    SERVER_STATE_DRAINING: _ClassVar[ServerState]
    SERVER_STATE_STOPPED: _ClassVar[ServerState]
    SERVER_STATE_WAITING: _ClassVar[ServerState]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_PS: _ClassVar[Mode]
    MODE_DDP: _ClassVar[Mode]
    MODE_FSDP: _ClassVar[Mode]

class UpdateMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_MODE_UNSPECIFIED: _ClassVar[UpdateMode]
    UPDATE_MODE_ASYNC: _ClassVar[UpdateMode]
    UPDATE_MODE_SYNC: _ClassVar[UpdateMode]
    UPDATE_MODE_COLLECTIVE: _ClassVar[UpdateMode]
    UPDATE_MODE_SSP: _ClassVar[UpdateMode]
    UPDATE_MODE_DILOCO: _ClassVar[UpdateMode]

class TrainerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINER_STATE_UNSPECIFIED: _ClassVar[TrainerState]
    TRAINER_STATE_ACTIVE: _ClassVar[TrainerState]
    TRAINER_STATE_LEFT: _ClassVar[TrainerState]
    TRAINER_STATE_LOST: _ClassVar[TrainerState]

class ServerProcessState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_PROCESS_STATE_UNSPECIFIED: _ClassVar[ServerProcessState]
    SERVER_PROCESS_STATE_SERVING: _ClassVar[ServerProcessState]
    SERVER_PROCESS_STATE_LOST: _ClassVar[ServerProcessState]
    SERVER_PROCESS_STATE_MISSING: _ClassVar[ServerProcessState]
SERVER_STATE_UNSPECIFIED: ServerState
SERVER_STATE_STARTING: ServerState
SERVER_STATE_SERVING: ServerState
SERVER_STATE_DRAINING: ServerState
SERVER_STATE_STOPPED: ServerState
SERVER_STATE_WAITING: ServerState
MODE_UNSPECIFIED: Mode
MODE_PS: Mode
MODE_DDP: Mode
MODE_FSDP: Mode
UPDATE_MODE_UNSPECIFIED: UpdateMode
UPDATE_MODE_ASYNC: UpdateMode
UPDATE_MODE_SYNC: UpdateMode
UPDATE_MODE_COLLECTIVE: UpdateMode
UPDATE_MODE_SSP: UpdateMode
UPDATE_MODE_DILOCO: UpdateMode
TRAINER_STATE_UNSPECIFIED: TrainerState
TRAINER_STATE_ACTIVE: TrainerState
TRAINER_STATE_LEFT: TrainerState
TRAINER_STATE_LOST: TrainerState
SERVER_PROCESS_STATE_UNSPECIFIED: ServerProcessState
SERVER_PROCESS_STATE_SERVING: ServerProcessState
SERVER_PROCESS_STATE_LOST: ServerProcessState
SERVER_PROCESS_STATE_MISSING: ServerProcessState

class RowsSinceRequest(_message.Message):
    __slots__ = ("table", "since", "dtype", "reader")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    READER_FIELD_NUMBER: _ClassVar[int]
    table: str
    since: int
    dtype: str
    reader: str
    def __init__(self, table: _Optional[str] = ..., since: _Optional[int] = ..., dtype: _Optional[str] = ..., reader: _Optional[str] = ...) -> None: ...

class RowsDelta(_message.Message):
    __slots__ = ("step", "full", "width", "dtype", "gone", "ids", "rows")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    step: int
    full: bool
    width: int
    dtype: str
    gone: bytes
    ids: bytes
    rows: bytes
    def __init__(self, step: _Optional[int] = ..., full: _Optional[bool] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ..., gone: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ...) -> None: ...

class RowsRequest(_message.Message):
    __slots__ = ("table", "ids", "dtype")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    dtype: str
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., dtype: _Optional[str] = ...) -> None: ...

class RowsResponse(_message.Message):
    __slots__ = ("step", "width", "dtype", "rows")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    step: int
    width: int
    dtype: str
    rows: bytes
    def __init__(self, step: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ..., rows: _Optional[bytes] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("newer_than", "timeout_seconds", "dtype", "reader", "sharing", "host", "history")
    NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    READER_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    newer_than: int
    timeout_seconds: float
    dtype: str
    reader: str
    sharing: int
    host: str
    history: str
    def __init__(self, newer_than: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., dtype: _Optional[str] = ..., reader: _Optional[str] = ..., sharing: _Optional[int] = ..., host: _Optional[str] = ..., history: _Optional[str] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("key", "dtype", "shape", "nbytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class VersionHeader(_message.Message):
    __slots__ = ("step", "published_at", "tensors", "nbytes", "crc32", "model", "server_time", "path", "history")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    step: int
    published_at: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    nbytes: int
    crc32: int
    model: str
    server_time: float
    path: str
    history: str
    def __init__(self, step: _Optional[int] = ..., published_at: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ..., model: _Optional[str] = ..., server_time: _Optional[float] = ..., path: _Optional[str] = ..., history: _Optional[str] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: VersionHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[VersionHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightReader(_message.Message):
    __slots__ = ("name", "peer", "step", "read_at", "age_seconds", "reads", "sharing")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    READ_AT_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    name: str
    peer: str
    step: int
    read_at: float
    age_seconds: float
    reads: int
    sharing: int
    def __init__(self, name: _Optional[str] = ..., peer: _Optional[str] = ..., step: _Optional[int] = ..., read_at: _Optional[float] = ..., age_seconds: _Optional[float] = ..., reads: _Optional[int] = ..., sharing: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class ListTrainersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("index", "device", "num_params", "bytes", "state_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    device: str
    num_params: int
    bytes: int
    state_bytes: int
    def __init__(self, index: _Optional[int] = ..., device: _Optional[str] = ..., num_params: _Optional[int] = ..., bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("path", "step", "time")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    time: float
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., time: _Optional[float] = ...) -> None: ...

class ServerProcess(_message.Message):
    __slots__ = ("rank", "name", "host", "state", "num_params", "bytes", "updates_applied", "last_seen_age_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    name: str
    host: str
    state: ServerProcessState
    num_params: int
    bytes: int
    updates_applied: int
    last_seen_age_seconds: float
    def __init__(self, rank: _Optional[int] = ..., name: _Optional[str] = ..., host: _Optional[str] = ..., state: _Optional[_Union[ServerProcessState, str]] = ..., num_params: _Optional[int] = ..., bytes: _Optional[int] = ..., updates_applied: _Optional[int] = ..., last_seen_age_seconds: _Optional[float] = ...) -> None: ...

class EmbeddingTable(_message.Message):
    __slots__ = ("table", "server_rank", "rows", "max_rows", "dim", "bytes", "admissions", "refused", "evictions", "expirations", "lookups", "updates", "lookups_per_second", "updates_per_second")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SERVER_RANK_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    UPDATES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    table: str
    server_rank: int
    rows: int
    max_rows: int
    dim: int
    bytes: int
    admissions: int
    refused: int
    evictions: int
    expirations: int
    lookups: int
    updates: int
    lookups_per_second: float
    updates_per_second: float
    def __init__(self, table: _Optional[str] = ..., server_rank: _Optional[int] = ..., rows: _Optional[int] = ..., max_rows: _Optional[int] = ..., dim: _Optional[int] = ..., bytes: _Optional[int] = ..., admissions: _Optional[int] = ..., refused: _Optional[int] = ..., evictions: _Optional[int] = ..., expirations: _Optional[int] = ..., lookups: _Optional[int] = ..., updates: _Optional[int] = ..., lookups_per_second: _Optional[float] = ..., updates_per_second: _Optional[float] = ...) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("version", "state", "mode", "started_at", "uptime_seconds", "model", "num_params", "update_mode", "sync_trainers", "global_step", "samples_seen", "updates_per_second", "samples_per_second", "mean_loss", "shards", "last_checkpoint", "server_time", "staleness", "nonfinite_gradients", "clipped_steps", "servers", "tables", "learning_rate", "lr_schedule", "memory_state", "stale_state", "diloco", "readers", "versions_copied", "weights_bytes_sent")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MODE_FIELD_NUMBER: _ClassVar[int]
    SYNC_TRAINERS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SEEN_FIELD_NUMBER: _ClassVar[int]
    UPDATES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STATE_FIELD_NUMBER: _ClassVar[int]
    STALE_STATE_FIELD_NUMBER: _ClassVar[int]
    DILOCO_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_COPIED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    version: str
    state: ServerState
    mode: Mode
    started_at: float
    uptime_seconds: float
    model: str
    num_params: int
    update_mode: UpdateMode
    sync_trainers: int
    global_step: int
    samples_seen: int
    updates_per_second: float
    samples_per_second: float
    mean_loss: float
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    last_checkpoint: CheckpointInfo
    server_time: float
    staleness: int
    nonfinite_gradients: int
    clipped_steps: int
    servers: _containers.RepeatedCompositeFieldContainer[ServerProcess]
    tables: _containers.RepeatedCompositeFieldContainer[EmbeddingTable]
    learning_rate: float
    lr_schedule: str
    memory_state: str
    stale_state: _containers.RepeatedCompositeFieldContainer[StaleState]
    diloco: str
    readers: _containers.RepeatedCompositeFieldContainer[WeightReader]
    versions_copied: int
    weights_bytes_sent: int
    def __init__(self, version: _Optional[str] = ..., state: _Optional[_Union[ServerState, str]] = ..., mode: _Optional[_Union[Mode, str]] = ..., started_at: _Optional[float] = ..., uptime_seconds: _Optional[float] = ..., model: _Optional[str] = ..., num_params: _Optional[int] = ..., update_mode: _Optional[_Union[UpdateMode, str]] = ..., sync_trainers: _Optional[int] = ..., global_step: _Optional[int] = ..., samples_seen: _Optional[int] = ..., updates_per_second: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., mean_loss: _Optional[float] = ..., shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ..., last_checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., server_time: _Optional[float] = ..., staleness: _Optional[int] = ..., nonfinite_gradients: _Optional[int] = ..., clipped_steps: _Optional[int] = ..., servers: _Optional[_Iterable[_Union[ServerProcess, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[EmbeddingTable, _Mapping]]] = ..., learning_rate: _Optional[float] = ..., lr_schedule: _Optional[str] = ..., memory_state: _Optional[str] = ..., stale_state: _Optional[_Iterable[_Union[StaleState, _Mapping]]] = ..., diloco: _Optional[str] = ..., readers: _Optional[_Iterable[_Union[WeightReader, _Mapping]]] = ..., versions_copied: _Optional[int] = ..., weights_bytes_sent: _Optional[int] = ...) -> None: ...

class StaleState(_message.Message):
    __slots__ = ("path", "bytes", "run", "pid", "started_at")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes: int
    run: str
    pid: int
    started_at: float
    def __init__(self, path: _Optional[str] = ..., bytes: _Optional[int] = ..., run: _Optional[str] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class Trainer(_message.Message):
    __slots__ = ("rank", "name", "host", "joined_at", "last_seen", "steps", "samples", "last_loss", "samples_per_second", "state", "clock", "staleness", "max_staleness", "step", "nonfinite", "clipped", "reason", "updates", "transport", "transport_reason", "received_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_REASON_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    name: str
    host: str
    joined_at: float
    last_seen: float
    steps: int
    samples: int
    last_loss: float
    samples_per_second: float
    state: TrainerState
    clock: int
    staleness: int
    max_staleness: int
    step: str
    nonfinite: int
    clipped: int
    reason: str
    updates: int
    transport: str
    transport_reason: str
    received_bytes: int
    def __init__(self, rank: _Optional[int] = ..., name: _Optional[str] = ..., host: _Optional[str] = ..., joined_at: _Optional[float] = ..., last_seen: _Optional[float] = ..., steps: _Optional[int] = ..., samples: _Optional[int] = ..., last_loss: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., state: _Optional[_Union[TrainerState, str]] = ..., clock: _Optional[int] = ..., staleness: _Optional[int] = ..., max_staleness: _Optional[int] = ..., step: _Optional[str] = ..., nonfinite: _Optional[int] = ..., clipped: _Optional[int] = ..., reason: _Optional[str] = ..., updates: _Optional[int] = ..., transport: _Optional[str] = ..., transport_reason: _Optional[str] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class ListTrainersResponse(_message.Message):
    __slots__ = ("trainers", "server_time")
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    trainers: _containers.RepeatedCompositeFieldContainer[Trainer]
    server_time: float
    def __init__(self, trainers: _Optional[_Iterable[_Union[Trainer, _Mapping]]] = ..., server_time: _Optional[float] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: ServerState
    def __init__(self, state: _Optional[_Union[ServerState, str]] = ...) -> None: ...
