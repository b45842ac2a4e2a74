from google.rpc import status_pb2 as _status_pb2
from maskwire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MaskRowEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MASK_ROW_ENCODING_UNSPECIFIED: _ClassVar[MaskRowEncoding]
    MASK_ROW_ENCODING_DENSE: _ClassVar[MaskRowEncoding]
    MASK_ROW_ENCODING_SPARSE_ZEROS: _ClassVar[MaskRowEncoding]
    MASK_ROW_ENCODING_SPARSE_ONES: _ClassVar[MaskRowEncoding]
    MASK_ROW_ENCODING_REPEAT: _ClassVar[MaskRowEncoding]

class RowStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_STATUS_UNSPECIFIED: _ClassVar[RowStatus]
    ROW_STATUS_OK: _ClassVar[RowStatus]
    ROW_STATUS_DESYNC: _ClassVar[RowStatus]
    ROW_STATUS_ERROR: _ClassVar[RowStatus]
    ROW_STATUS_UNKNOWN_REQUEST: _ClassVar[RowStatus]
MASK_ROW_ENCODING_UNSPECIFIED: MaskRowEncoding
MASK_ROW_ENCODING_DENSE: MaskRowEncoding
MASK_ROW_ENCODING_SPARSE_ZEROS: MaskRowEncoding
MASK_ROW_ENCODING_SPARSE_ONES: MaskRowEncoding
MASK_ROW_ENCODING_REPEAT: MaskRowEncoding
ROW_STATUS_UNSPECIFIED: RowStatus
ROW_STATUS_OK: RowStatus
ROW_STATUS_DESYNC: RowStatus
ROW_STATUS_ERROR: RowStatus
ROW_STATUS_UNKNOWN_REQUEST: RowStatus

class CompileRequest(_message.Message):
    __slots__ = ("constraint", "tokenizer")
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    constraint: _common_pb2.Constraint
    tokenizer: _common_pb2.TokenizerFingerprint
    def __init__(self, constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., tokenizer: _Optional[_Union[_common_pb2.TokenizerFingerprint, _Mapping]] = ...) -> None: ...

class CompileResponse(_message.Message):
    __slots__ = ("grammar_id", "warnings", "cached", "compile_ms", "schema_report")
    GRAMMAR_ID_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_REPORT_FIELD_NUMBER: _ClassVar[int]
    grammar_id: str
    warnings: _containers.RepeatedScalarFieldContainer[str]
    cached: bool
    compile_ms: float
    schema_report: _common_pb2.SchemaReport
    def __init__(self, grammar_id: _Optional[str] = ..., warnings: _Optional[_Iterable[str]] = ..., cached: _Optional[bool] = ..., compile_ms: _Optional[float] = ..., schema_report: _Optional[_Union[_common_pb2.SchemaReport, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "step", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    step: Step
    close: Close
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("opened", "step_result", "closed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_RESULT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    step_result: StepResult
    closed: Closed
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., step_result: _Optional[_Union[StepResult, _Mapping]] = ..., closed: _Optional[_Union[Closed, _Mapping]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("request_id", "constraint", "grammar_id", "tokenizer", "options", "replay_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    constraint: _common_pb2.Constraint
    grammar_id: str
    tokenizer: _common_pb2.TokenizerFingerprint
    options: RequestOptions
    replay_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., grammar_id: _Optional[str] = ..., tokenizer: _Optional[_Union[_common_pb2.TokenizerFingerprint, _Mapping]] = ..., options: _Optional[_Union[RequestOptions, _Mapping]] = ..., replay_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestOptions(_message.Message):
    __slots__ = ("reasoning_end_marker", "jump_forward")
    REASONING_END_MARKER_FIELD_NUMBER: _ClassVar[int]
    JUMP_FORWARD_FIELD_NUMBER: _ClassVar[int]
    reasoning_end_marker: str
    jump_forward: bool
    def __init__(self, reasoning_end_marker: _Optional[str] = ..., jump_forward: _Optional[bool] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("request_id", "warnings", "error", "position", "schema_report")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_REPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    warnings: _containers.RepeatedScalarFieldContainer[str]
    error: _status_pb2.Status
    position: int
    schema_report: _common_pb2.SchemaReport
    def __init__(self, request_id: _Optional[str] = ..., warnings: _Optional[_Iterable[str]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., position: _Optional[int] = ..., schema_report: _Optional[_Union[_common_pb2.SchemaReport, _Mapping]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("step", "rows", "compact_masks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_MASKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rows: _containers.RepeatedCompositeFieldContainer[StepRow]
    compact_masks: bool
    def __init__(self, step: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[StepRow, _Mapping]]] = ..., compact_masks: _Optional[bool] = ...) -> None: ...

class StepRow(_message.Message):
    __slots__ = ("request_id", "new_tokens", "position", "draft_tokens", "forced_draft_room")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCED_DRAFT_ROOM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    position: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    forced_draft_room: int
    def __init__(self, request_id: _Optional[str] = ..., new_tokens: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., forced_draft_room: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "rows", "bitmask", "words_per_row", "mask_row_encodings", "mask_row_word_counts", "mask_word_index", "mask_word_values", "mask_row_repeat_of", "vocab_size")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    WORDS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    MASK_ROW_ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    MASK_ROW_WORD_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MASK_WORD_INDEX_FIELD_NUMBER: _ClassVar[int]
    MASK_WORD_VALUES_FIELD_NUMBER: _ClassVar[int]
    MASK_ROW_REPEAT_OF_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    step: int
    rows: _containers.RepeatedCompositeFieldContainer[RowResult]
    bitmask: bytes
    words_per_row: int
    mask_row_encodings: _containers.RepeatedScalarFieldContainer[MaskRowEncoding]
    mask_row_word_counts: _containers.RepeatedScalarFieldContainer[int]
    mask_word_index: bytes
    mask_word_values: bytes
    mask_row_repeat_of: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    def __init__(self, step: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowResult, _Mapping]]] = ..., bitmask: _Optional[bytes] = ..., words_per_row: _Optional[int] = ..., mask_row_encodings: _Optional[_Iterable[_Union[MaskRowEncoding, str]]] = ..., mask_row_word_counts: _Optional[_Iterable[int]] = ..., mask_word_index: _Optional[bytes] = ..., mask_word_values: _Optional[bytes] = ..., mask_row_repeat_of: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class RowResult(_message.Message):
    __slots__ = ("request_id", "status", "mask_rows", "accepted_drafts", "ff_tokens", "accepting", "finished", "position", "expected_position", "error", "forced_drafts", "forced_jump_start", "forced_jump_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    FF_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_POSITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FORCED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    FORCED_JUMP_START_FIELD_NUMBER: _ClassVar[int]
    FORCED_JUMP_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: RowStatus
    mask_rows: int
    accepted_drafts: int
    ff_tokens: _containers.RepeatedScalarFieldContainer[int]
    accepting: bool
    finished: bool
    position: int
    expected_position: int
    error: _status_pb2.Status
    forced_drafts: _containers.RepeatedScalarFieldContainer[int]
    forced_jump_start: int
    forced_jump_count: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[RowStatus, str]] = ..., mask_rows: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., ff_tokens: _Optional[_Iterable[int]] = ..., accepting: _Optional[bool] = ..., finished: _Optional[bool] = ..., position: _Optional[int] = ..., expected_position: _Optional[int] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., forced_drafts: _Optional[_Iterable[int]] = ..., forced_jump_start: _Optional[int] = ..., forced_jump_count: _Optional[int] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Closed(_message.Message):
    __slots__ = ("request_id", "found")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    found: bool
    def __init__(self, request_id: _Optional[str] = ..., found: _Optional[bool] = ...) -> None: ...
