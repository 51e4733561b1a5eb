from tandem.rpc import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KvTransport]
    KV_TRANSPORT_CUDA_IPC: _ClassVar[KvTransport]
    KV_TRANSPORT_SHM: _ClassVar[KvTransport]
    KV_TRANSPORT_NIXL: _ClassVar[KvTransport]
    KV_TRANSPORT_INLINE: _ClassVar[KvTransport]
KV_TRANSPORT_UNSPECIFIED: KvTransport
KV_TRANSPORT_CUDA_IPC: KvTransport
KV_TRANSPORT_SHM: KvTransport
KV_TRANSPORT_NIXL: KvTransport
KV_TRANSPORT_INLINE: KvTransport

class PoolLayout(_message.Message):
    __slots__ = ("num_layers", "num_blocks", "block_size", "kv_heads", "head_dim", "dtype", "layout_version")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    layout_version: int
    def __init__(self, num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., layout_version: _Optional[int] = ...) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("kind", "pool_id", "layout", "shm_name", "cuda_ipc", "device_uuid", "host_id", "nixl", "transport")
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    pool_id: str
    layout: PoolLayout
    shm_name: str
    cuda_ipc: bytes
    device_uuid: str
    host_id: str
    nixl: NixlPool
    transport: KvTransport
    def __init__(self, kind: _Optional[str] = ..., pool_id: _Optional[str] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., shm_name: _Optional[str] = ..., cuda_ipc: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., host_id: _Optional[str] = ..., nixl: _Optional[_Union[NixlPool, _Mapping]] = ..., transport: _Optional[_Union[KvTransport, str]] = ...) -> None: ...

class NixlPool(_message.Message):
    __slots__ = ("agent_metadata", "mem_type", "device_id", "data_addr", "scales_addr")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    SCALES_ADDR_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    mem_type: str
    device_id: int
    data_addr: int
    scales_addr: int
    def __init__(self, agent_metadata: _Optional[bytes] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ..., data_addr: _Optional[int] = ..., scales_addr: _Optional[int] = ...) -> None: ...

class KvRef(_message.Message):
    __slots__ = ("pool_id", "block_ids", "num_tokens", "lease_id", "lease_signature", "expires_at", "block_names")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NAMES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_id: str
    lease_signature: bytes
    expires_at: float
    block_names: bytes
    def __init__(self, pool_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_signature: _Optional[bytes] = ..., expires_at: _Optional[float] = ..., block_names: _Optional[bytes] = ...) -> None: ...

class KvReservation(_message.Message):
    __slots__ = ("pool_id", "token", "seq_id", "first_block", "block_ids", "num_tokens", "expires_at", "signature", "writer_pool_id", "prompt_digest")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    WRITER_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    token: str
    seq_id: str
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    expires_at: float
    signature: bytes
    writer_pool_id: str
    prompt_digest: bytes
    def __init__(self, pool_id: _Optional[str] = ..., token: _Optional[str] = ..., seq_id: _Optional[str] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., expires_at: _Optional[float] = ..., signature: _Optional[bytes] = ..., writer_pool_id: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("peer_id", "layout", "accept_kinds", "host_id", "model", "nixl_agent_metadata", "device_uuid", "accept", "push_pool", "reservation_key")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_KINDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    PUSH_POOL_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_KEY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    layout: PoolLayout
    accept_kinds: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    model: str
    nixl_agent_metadata: bytes
    device_uuid: str
    accept: _containers.RepeatedScalarFieldContainer[KvTransport]
    push_pool: PoolHandle
    reservation_key: bytes
    def __init__(self, peer_id: _Optional[str] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., accept_kinds: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., model: _Optional[str] = ..., nixl_agent_metadata: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., accept: _Optional[_Iterable[_Union[KvTransport, str]]] = ..., push_pool: _Optional[_Union[PoolHandle, _Mapping]] = ..., reservation_key: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("handle", "model", "lease_key", "push")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEASE_KEY_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    handle: PoolHandle
    model: str
    lease_key: bytes
    push: bool
    def __init__(self, handle: _Optional[_Union[PoolHandle, _Mapping]] = ..., model: _Optional[str] = ..., lease_key: _Optional[bytes] = ..., push: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "tenant", "push_to")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PUSH_TO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingParams
    tenant: str
    push_to: KvReservation
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., tenant: _Optional[str] = ..., push_to: _Optional[_Union[KvReservation, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_logprob", "has_logprob", "kv", "rng_state", "queue_ms", "prefill_ms", "cached_tokens", "prompt_logprobs", "push_proof", "push_refused", "push_ms")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    RNG_STATE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PUSH_PROOF_FIELD_NUMBER: _ClassVar[int]
    PUSH_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PUSH_MS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprob: _api_pb2.TokenLogprob
    has_logprob: bool
    kv: KvRef
    rng_state: bytes
    queue_ms: float
    prefill_ms: float
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    push_proof: bytes
    push_refused: str
    push_ms: float
    def __init__(self, first_token: _Optional[int] = ..., first_logprob: _Optional[_Union[_api_pb2.TokenLogprob, _Mapping]] = ..., has_logprob: _Optional[bool] = ..., kv: _Optional[_Union[KvRef, _Mapping]] = ..., rng_state: _Optional[bytes] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ..., push_proof: _Optional[bytes] = ..., push_refused: _Optional[str] = ..., push_ms: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids", "transfer_error")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ERROR_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    transfer_error: str
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., transfer_error: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KvRef
    def __init__(self, kv: _Optional[_Union[KvRef, _Mapping]] = ...) -> None: ...

class BlockBytes(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("running", "waiting", "used_blocks", "total_blocks", "leased_blocks", "inline_bytes_sent", "registered_peers", "kv_imports", "imports_by_transport", "kv_transfer_failures", "kv_transfers_in_flight", "cached_free_blocks", "prefix_query_tokens", "prefix_hit_tokens", "block_size", "local_prefills", "leases", "refusals", "max_seq_tokens", "max_sequences", "reservations", "reserved_blocks", "pushes", "prefix_host_hit_tokens", "host_tier_blocks", "host_tier_capacity_blocks")
    class ImportsByTransportEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_PEERS_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    IMPORTS_BY_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CACHED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    used_blocks: int
    total_blocks: int
    leased_blocks: int
    inline_bytes_sent: int
    registered_peers: int
    kv_imports: int
    imports_by_transport: _containers.ScalarMap[str, int]
    kv_transfer_failures: int
    kv_transfers_in_flight: int
    cached_free_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    block_size: int
    local_prefills: int
    leases: int
    refusals: _containers.ScalarMap[str, int]
    max_seq_tokens: int
    max_sequences: int
    reservations: int
    reserved_blocks: int
    pushes: int
    prefix_host_hit_tokens: int
    host_tier_blocks: int
    host_tier_capacity_blocks: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., used_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., leased_blocks: _Optional[int] = ..., inline_bytes_sent: _Optional[int] = ..., registered_peers: _Optional[int] = ..., kv_imports: _Optional[int] = ..., imports_by_transport: _Optional[_Mapping[str, int]] = ..., kv_transfer_failures: _Optional[int] = ..., kv_transfers_in_flight: _Optional[int] = ..., cached_free_blocks: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., local_prefills: _Optional[int] = ..., leases: _Optional[int] = ..., refusals: _Optional[_Mapping[str, int]] = ..., max_seq_tokens: _Optional[int] = ..., max_sequences: _Optional[int] = ..., reservations: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., pushes: _Optional[int] = ..., prefix_host_hit_tokens: _Optional[int] = ..., host_tier_blocks: _Optional[int] = ..., host_tier_capacity_blocks: _Optional[int] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("removed", "tier", "hashes")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    tier: str
    hashes: bytes
    def __init__(self, removed: _Optional[bool] = ..., tier: _Optional[str] = ..., hashes: _Optional[bytes] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("seq", "pool_id", "reset", "events", "block_size", "total_blocks")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pool_id: str
    reset: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    block_size: int
    total_blocks: int
    def __init__(self, seq: _Optional[int] = ..., pool_id: _Optional[str] = ..., reset: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "tenant", "prefill_address")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    prefill_address: str
    def __init__(self, seq_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation", "refused")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    reservation: KvReservation
    refused: str
    def __init__(self, reservation: _Optional[_Union[KvReservation, _Mapping]] = ..., refused: _Optional[str] = ...) -> None: ...

class UnreserveRequest(_message.Message):
    __slots__ = ("token", "write_may_be_in_flight")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WRITE_MAY_BE_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    token: str
    write_may_be_in_flight: bool
    def __init__(self, token: _Optional[str] = ..., write_may_be_in_flight: _Optional[bool] = ...) -> None: ...

class UnreserveResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class Admit(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "first_token", "sampling", "kv", "prefill_address", "rng_state", "trace_context", "prefill_here", "tenant", "reservation", "push_proof")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RNG_STATE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    PUSH_PROOF_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: _api_pb2.SamplingParams
    kv: KvRef
    prefill_address: str
    rng_state: bytes
    trace_context: _containers.ScalarMap[str, str]
    prefill_here: bool
    tenant: str
    reservation: KvReservation
    push_proof: bytes
    def __init__(self, seq_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KvRef, _Mapping]] = ..., prefill_address: _Optional[str] = ..., rng_state: _Optional[bytes] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., prefill_here: _Optional[bool] = ..., tenant: _Optional[str] = ..., reservation: _Optional[_Union[KvReservation, _Mapping]] = ..., push_proof: _Optional[bytes] = ...) -> None: ...

class CancelSeq(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class DecodeIn(_message.Message):
    __slots__ = ("admit", "cancel")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    admit: Admit
    cancel: CancelSeq
    def __init__(self, admit: _Optional[_Union[Admit, _Mapping]] = ..., cancel: _Optional[_Union[CancelSeq, _Mapping]] = ...) -> None: ...

class SeqTokens(_message.Message):
    __slots__ = ("seq_id", "token_ids", "logprobs", "proposed_draft_tokens", "accepted_draft_tokens", "prompt_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    proposed_draft_tokens: int
    accepted_draft_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ..., proposed_draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class SeqFinished(_message.Message):
    __slots__ = ("seq_id", "finish_reason", "error", "kv_transfer_ms", "queue_ms", "kv_transport", "proposed_draft_tokens", "accepted_draft_tokens", "cached_prompt_tokens", "prefill_ms", "error_code")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    finish_reason: str
    error: str
    kv_transfer_ms: float
    queue_ms: float
    kv_transport: str
    proposed_draft_tokens: int
    accepted_draft_tokens: int
    cached_prompt_tokens: int
    prefill_ms: float
    error_code: str
    def __init__(self, seq_id: _Optional[str] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., kv_transfer_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., kv_transport: _Optional[str] = ..., proposed_draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., error_code: _Optional[str] = ...) -> None: ...

class DecodeOut(_message.Message):
    __slots__ = ("tokens", "finished", "step_ended_at")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STEP_ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[SeqTokens]
    finished: _containers.RepeatedCompositeFieldContainer[SeqFinished]
    step_ended_at: float
    def __init__(self, tokens: _Optional[_Iterable[_Union[SeqTokens, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[SeqFinished, _Mapping]]] = ..., step_ended_at: _Optional[float] = ...) -> None: ...

class DraftAdmitRequest(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftAdmitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftSync(_message.Message):
    __slots__ = ("seq_id", "start", "tokens", "k")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    def __init__(self, seq_id: _Optional[str] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("step", "seqs", "dropped")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    step: int
    seqs: _containers.RepeatedCompositeFieldContainer[DraftSync]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[DraftSync, _Mapping]]] = ..., dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("seq_id", "known", "tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    known: bool
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., known: _Optional[bool] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("step", "proposals")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    step: int
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    def __init__(self, step: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ...) -> None: ...
