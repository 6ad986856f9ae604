from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("request_id", "layout", "max_chunk_bytes", "host_id", "secret")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayout
    max_chunk_bytes: int
    host_id: str
    secret: str
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ..., host_id: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_computed", "layout", "block_hashes", "num_blocks", "total_bytes", "num_chunks", "first_logprob", "chunk_bytes", "chunk_checksums", "checksum", "shm_name", "finished_unix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed: int
    layout: KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_blocks: int
    total_bytes: int
    num_chunks: int
    first_logprob: float
    chunk_bytes: int
    chunk_checksums: _containers.RepeatedScalarFieldContainer[int]
    checksum: str
    shm_name: str
    finished_unix: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_blocks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., first_logprob: _Optional[float] = ..., chunk_bytes: _Optional[int] = ..., chunk_checksums: _Optional[_Iterable[int]] = ..., checksum: _Optional[str] = ..., shm_name: _Optional[str] = ..., finished_unix: _Optional[float] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("seq", "data", "crc32", "crc32c")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    seq: int
    data: bytes
    crc32: int
    crc32c: int
    def __init__(self, seq: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class PullKVResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ...) -> None: ...

class StreamKVRequest(_message.Message):
    __slots__ = ("request_id", "layout", "secret")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayout
    secret: str
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class KVLayerPiece(_message.Message):
    __slots__ = ("seq", "layer", "token_start", "token_end", "data", "crc32", "crc32c")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    seq: int
    layer: int
    token_start: int
    token_end: int
    data: bytes
    crc32: int
    crc32c: int
    def __init__(self, seq: _Optional[int] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class StreamKVResponse(_message.Message):
    __slots__ = ("header", "piece", "trailer", "heartbeat")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    piece: KVLayerPiece
    trailer: KVHeader
    heartbeat: StreamKVHeartbeat
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., piece: _Optional[_Union[KVLayerPiece, _Mapping]] = ..., trailer: _Optional[_Union[KVHeader, _Mapping]] = ..., heartbeat: _Optional[_Union[StreamKVHeartbeat, _Mapping]] = ...) -> None: ...

class StreamKVHeartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id", "secret")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    secret: str
    def __init__(self, request_id: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
