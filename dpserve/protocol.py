"""The dpserve wire protocol: one MessagePack array per ZMQ message, ``[header, *fields]``.

Every message that crosses the coordinator's ROUTER socket is described by one entry of
``MESSAGE_FIELDS``: its header and the types of its fields, in order. ``decode`` enforces the
size limit and the exact shape and raises ``ProtocolError`` for anything else, so the
coordinator, engines and clients handle every kind of bad input in one ``except`` clause.
``docs/protocol.md`` documents each message for humans; this module is the executable copy.

Token ids travel as packed little-endian int32 bytes (``pack_tokens``): decoding a
1,024-token ``list[int]`` with msgpack costs ~11-14 µs, the same tokens as bytes < 1 µs.
"""

from __future__ import annotations

import struct
import sys
import types
import typing
from array import array
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Final, NamedTuple

import msgpack

from dpserve.limits import DEFAULT_REQUEST_LIMITS

PROTOCOL_VERSION: Final = 1

# The default of ``decode``'s size limit (``dpserve.limits.RequestLimits.max_message_bytes``).
DEFAULT_MAX_MESSAGE_BYTES: Final = DEFAULT_REQUEST_LIMITS.max_message_bytes


class ProtocolError(ValueError):
    """A message that is not valid dpserve protocol: wrong size, bytes, shape or types."""


class MessageTooLarge(ProtocolError):
    """A message over the size limit; ``header`` and ``reference`` (its first field, the
    request, control or query id of the messages that have one) are read from its first
    bytes only, so the sender can be told which request was refused."""

    def __init__(self, size: int, limit: int, header: int | None, reference: int | None) -> None:
        super().__init__(f"message of {size} bytes exceeds the {limit}-byte limit")
        self.size = size
        self.limit = limit
        self.header = header
        self.reference = reference


class Header(IntEnum):
    """Message kinds. The numbers are part of the wire format: never renumber, only add."""

    # Handshakes and membership (1-19).
    CONNECT = 1
    CONNECT_ACK = 2
    REGISTER = 3
    REGISTER_ACK = 4
    HEARTBEAT = 5
    HEARTBEAT_ACK = 6
    DRAIN = 7
    DRAIN_ACK = 8
    DEREGISTER = 9
    HAND_OFF = 10
    HAND_OFF_ACK = 11

    # Requests and results (20-39).
    SUBMIT_REQUEST = 20
    ENGINE_REQUEST = 21
    ENGINE_REPLY = 22
    RESULTS = 23
    STREAM = 24
    CANCEL = 25
    ENGINE_REQUESTS = 26  # several ENGINE_REQUESTs in one message (to engines that say so)
    SUBMIT_REQUESTS = 27  # several SUBMIT_REQUESTs in one message (to coordinators that say so)

    # Control signals, relayed to every engine and acknowledged (40-59).
    PAUSE = 40
    UNPAUSE = 41
    SUSPEND = 42
    RESUME = 43
    STOP = 44
    CONTROL_ACK = 45
    # LoRA adapters: loaded or unloaded on every engine, each engine's outcome gathered.
    LOAD_ADAPTER = 46
    UNLOAD_ADAPTER = 47
    ADAPTER_ACK = 48

    # Introspection (60-69).
    STATUS = 60
    STATUS_REPLY = 61

    # Prefix cache: what each engine's KV cache holds, for cache-aware routing (70-79).
    KV_EVENTS = 70
    KV_SNAPSHOT_REQUEST = 71

    # Errors (90-99).
    ERROR = 90


CONTROL_SIGNALS: Final = frozenset(
    {Header.PAUSE, Header.UNPAUSE, Header.SUSPEND, Header.RESUME, Header.STOP}
)
# Relayed to every engine like control signals, but change no control state (any number may
# be in flight) and are answered with ADAPTER_ACK, which carries the engines' errors.
ADAPTER_SIGNALS: Final = frozenset({Header.LOAD_ADAPTER, Header.UNLOAD_ADAPTER})


class ErrorCode:
    """Machine-readable ``code`` of an ERROR message; the ``message`` field is for humans."""

    BAD_MESSAGE = "bad_message"
    BAD_REQUEST = "bad_request"  # invalid prompt or sampling parameters
    UNKNOWN_PEER = "unknown_peer"  # handshake first (CONNECT or REGISTER)
    NO_ENGINE = "no_engine"  # no engine became available before the queue timeout
    OVERLOADED = "overloaded"
    INVALID_TRANSITION = "invalid_transition"
    CONTROL_BUSY = "control_busy"
    STOPPED = "stopped"
    ENGINE_ERROR = "engine_error"  # the engine refused or failed the request
    PROMPT_TOO_LONG = "prompt_too_long"
    CANCELLED = "cancelled"
    FORBIDDEN = "forbidden"  # the connection's role may not send this message
    MESSAGE_TOO_LARGE = "message_too_large"  # over the coordinator's message size limit
    # In flight on AdmissionLimits.max_dispatch_attempts engines that each died: not retried.
    QUARANTINED = "quarantined"


class ControlState(IntEnum):
    """The engines' control state, as the coordinator sends it in REGISTER_ACK."""

    RUNNING = 0
    PAUSED = 1  # engines keep their requests and accept new ones, but do not step
    SUSPENDED = 2  # paused, and the model's and KV cache's memory released
    STOPPED = 3  # engines exited; the coordinator answers every request with an error


# ------------------------------------------------------------------ wire records
#
# One NamedTuple per message: its fields after the header, in wire order, with the types
# ``decode`` accepts. ``encode(record)`` writes ``[header, *record]`` and ``decode`` returns
# the record (the entries of ENGINE_REPLY, RESULTS and STREAM as entry records); a field with
# a default may be left off the end on the wire (older senders). docs/protocol.md lists the same
# records; tests/unit/test_protocol.py checks that the page and these classes agree.

Prompt = str | bytes | list[int] | list[dict[str, str]]


class Connect(NamedTuple):
    protocol_version: int


class ConnectAck(NamedTuple):
    instance: str  # the coordinator's instance id: another one later means it restarted
    protocol_version: int
    # The most bytes of a SUBMIT_REQUESTS message this coordinator reads (0: it reads none;
    # send one SUBMIT_REQUEST per request). Optional: added after protocol version 1.
    submit_batch_bytes: int = 0


class Register(NamedTuple):
    rank: int
    capacity: int
    instance: str  # the engine's instance id: another one means a restarted engine
    # 1: the engine reads ENGINE_REQUESTS, and the coordinator sends it every request of one
    # of its turns in one message (an int: no field is a bool on the wire). Optional: added
    # after protocol version 1; an engine that leaves it off gets one ENGINE_REQUEST each.
    batched_requests: int = 0
    # The LoRA adapters the engine loaded at run time (LOAD_ADAPTER; not its --lora-modules,
    # which every engine started with those flags holds anyway), name -> directory: a
    # restarted coordinator adopts those it does not know and sends them to engines that
    # register later (coordinator.adapters checks them). None: none. Optional: added after
    # protocol version 1.
    adapters: dict[str, str] | None = None


class RegisterAck(NamedTuple):
    instance: str
    state: int  # ControlState


class Heartbeat(NamedTuple):
    held: int  # requests held by the sender (0 for clients)
    # An engine's runner numbers (KV pool size, free blocks, capacity, preemptions), name ->
    # int or float, for STATUS and /metrics; the coordinator checks them (engine_stats).
    # Optional: added after protocol version 1.
    stats: dict[str, Any] | None = None
    # An engine's LoRA adapters (``engine.lora.serving.AdapterReport.to_wire``): max_loras and
    # per registered adapter [loaded, running, waiting]; None: LoRA not enabled. Optional:
    # added after protocol version 1.
    adapters: dict[str, Any] | None = None


class HeartbeatAck(NamedTuple):
    instance: str


class Drain(NamedTuple):
    pass


class DrainAck(NamedTuple):
    pass


class Deregister(NamedTuple):
    pass


class HandOff(NamedTuple):
    """An engine leaving (SIGTERM): it sent every token it produced, and asks the coordinator
    to re-dispatch what it holds to the other engines, continuing after those tokens."""


class HandOffAck(NamedTuple):
    """The engine's requests went to other engines: it drops them and exits. (With no other
    engine to take them the coordinator answers DRAIN_ACK instead: the engine finishes them.)"""

    requests: int  # how many requests were handed to other engines


class SubmitRequest(NamedTuple):
    client_request_id: int
    prompt: Prompt  # text, packed tokens, token ids, or chat messages
    sampling_params: dict[str, Any]
    # Tokens the client already has (a stream resubmitted after a coordinator restart):
    # generation continues after them. Optional: added after protocol version 1.
    resume_tokens: bytes = b""


class EngineRequest(NamedTuple):
    request_id: int
    prompt_tokens: bytes
    sampling_params: dict[str, Any]  # validated, SamplingParams.serialize() form
    resume_tokens: bytes  # generated elsewhere already: generation continues after them


class EngineUpdate(NamedTuple):
    """One entry of ENGINE_REPLY: what an engine produced for one request since its last."""

    request_id: int
    tokens: bytes
    logprobs: bytes | None  # float32, one per token, when asked for
    finish_reason: str | None
    error: str | None  # the request failed; finish_reason then holds the ErrorCode
    ttft: float | None  # engine-side seconds to the first token
    text: str | None = None  # the tokens' text (incremental detokenization on the engine)
    # Prompt tokens the engine found in its prefix cache (sent with the finishing update).
    # Optional: added after protocol version 1.
    cached_tokens: int | None = None
    # pack_logprobs of the prompt's tokens after the first (sampling param prompt_logprobs),
    # in the request's first update only. Optional: added after protocol version 1.
    prompt_logprobs: bytes | None = None
    # The stop token that ended the request (finish_reason "stop"; not in tokens). Optional:
    # added after protocol version 1.
    stop_token: int | None = None
    # pack_logprobs of that stop token alone (with its alternatives), when log-probs were
    # asked for: clients that score text (lm-evaluation-harness) read one entry per generated
    # token, the stop token included, as vLLM returns them. Optional: after version 1.
    stop_logprob: bytes | None = None


class SubmitRequests(NamedTuple):
    """Every request a client submits in one turn of its event loop: a send per turn, not per
    request, as ``EngineRequests`` (a client's send and the coordinator's receive per request
    were ~10-15 % of their CPU in bench/coordinator.py; issue 36)."""

    requests: list[SubmitRequest]


class EngineRequests(NamedTuple):
    """Every request a coordinator's turn sends one engine: a send per turn, not per request
    (each ZMQ send wakes the I/O threads of both ends; at a few thousand requests a second
    those sends were a quarter of the coordinator's CPU)."""

    requests: list[EngineRequest]


class EngineReply(NamedTuple):
    updates: list[EngineUpdate]


class ClientResult(NamedTuple):
    """One entry of RESULTS: a finished request as its client receives it."""

    client_request_id: int
    prompt_tokens: bytes
    generated_tokens: bytes
    text: str
    finish_reason: str
    logprobs: bytes | None  # pack_logprobs: with top_logprobs alternatives when asked for
    ttft: float | None  # seconds from the coordinator receiving it to the first token
    engine_rank: int
    # Prompt tokens served from the engine's prefix cache (OpenAI's usage cached_tokens).
    # Optional: added after protocol version 1.
    cached_tokens: int | None = None
    prompt_logprobs: bytes | None = None  # as EngineUpdate's; optional (after version 1)
    stop_token: int | None = None  # as EngineUpdate's; optional (after version 1)
    stop_logprob: bytes | None = None  # as EngineUpdate's; optional (after version 1)


class Results(NamedTuple):
    results: list[ClientResult]


class ClientChunk(NamedTuple):
    """One entry of STREAM: a streaming request's new tokens and their text."""

    client_request_id: int
    tokens: bytes
    text: str
    # pack_logprobs of these tokens when the request asked for them; optional (after version 1)
    logprobs: bytes | None = None


class Stream(NamedTuple):
    chunks: list[ClientChunk]


class Cancel(NamedTuple):
    ref: int  # client request id (client -> coordinator), request id (coordinator -> engine)


class Pause(NamedTuple):
    control_id: int


class Unpause(NamedTuple):
    control_id: int


class Suspend(NamedTuple):
    control_id: int


class Resume(NamedTuple):
    control_id: int


class Stop(NamedTuple):
    control_id: int


class ControlAck(NamedTuple):
    signal: int  # the signal's Header
    control_id: int


class LoadAdapter(NamedTuple):
    """Load LoRA adapter ``name`` from the PEFT directory ``path`` (as the engines see it)."""

    control_id: int
    name: str
    path: str


class UnloadAdapter(NamedTuple):
    control_id: int
    name: str


class AdapterAck(NamedTuple):
    """The answer to LOAD_ADAPTER or UNLOAD_ADAPTER: from an engine, its own outcome; from
    the coordinator, every engine's (their errors, each prefixed with the engine's rank)."""

    control_id: int
    error: str | None  # None: done everywhere


class Status(NamedTuple):
    query_id: int


class StatusReply(NamedTuple):
    query_id: int
    status: dict[str, Any]


class KvEvent(NamedTuple):
    """One entry of KV_EVENTS: a change of the block hashes an engine's cache holds."""

    kind: int  # 0 stored, 1 removed, 2 cleared (everything before it is gone)
    hashes: bytes  # block hashes, little-endian uint64 (block_hash.pack_hashes)
    parent: int | None  # stored: the hash of the block before the first (0 at a prompt's start)


class KvEvents(NamedTuple):
    """A batch of an engine's KV events, numbered per engine incarnation: a gap in the
    numbers means some were lost, and the coordinator asks for a snapshot (a batch that
    starts with a cleared event and lists everything held)."""

    instance: str  # the engine's instance id (as in REGISTER): numbers restart with it
    number: int  # 0, 1, 2, ... per instance
    block_size: int  # tokens per block: what the hashes were computed over
    events: list[KvEvent]


class KvSnapshotRequest(NamedTuple):
    pass


class Error(NamedTuple):
    ref: int | None  # the request, control or query id, when the refused message had one
    code: str  # ErrorCode
    message: str


RECORDS: Final[dict[Header, Any]] = {
    Header.CONNECT: Connect,
    Header.CONNECT_ACK: ConnectAck,
    Header.REGISTER: Register,
    Header.REGISTER_ACK: RegisterAck,
    Header.HEARTBEAT: Heartbeat,
    Header.HEARTBEAT_ACK: HeartbeatAck,
    Header.DRAIN: Drain,
    Header.DRAIN_ACK: DrainAck,
    Header.DEREGISTER: Deregister,
    Header.HAND_OFF: HandOff,
    Header.HAND_OFF_ACK: HandOffAck,
    Header.SUBMIT_REQUEST: SubmitRequest,
    Header.SUBMIT_REQUESTS: SubmitRequests,
    Header.ENGINE_REQUEST: EngineRequest,
    Header.ENGINE_REQUESTS: EngineRequests,
    Header.ENGINE_REPLY: EngineReply,
    Header.RESULTS: Results,
    Header.STREAM: Stream,
    Header.CANCEL: Cancel,
    Header.PAUSE: Pause,
    Header.UNPAUSE: Unpause,
    Header.SUSPEND: Suspend,
    Header.RESUME: Resume,
    Header.STOP: Stop,
    Header.CONTROL_ACK: ControlAck,
    Header.LOAD_ADAPTER: LoadAdapter,
    Header.UNLOAD_ADAPTER: UnloadAdapter,
    Header.ADAPTER_ACK: AdapterAck,
    Header.STATUS: Status,
    Header.STATUS_REPLY: StatusReply,
    Header.KV_EVENTS: KvEvents,
    Header.KV_SNAPSHOT_REQUEST: KvSnapshotRequest,
    Header.ERROR: Error,
}
HEADER_OF: Final[dict[type, Header]] = {record: header for header, record in RECORDS.items()}

FieldTypes = tuple[tuple[type, ...], ...]


def _accepted(hint: Any) -> tuple[type, ...]:
    """The Python types ``decode`` accepts for a field annotated ``hint``."""
    if isinstance(hint, types.UnionType):
        return tuple(t for arg in hint.__args__ for t in _accepted(arg))
    base = typing.get_origin(hint) or hint
    return (float, int) if base is float else (base,)  # msgpack writes 2.0 as an int


def field_types(record: Any) -> FieldTypes:
    """The accepted types of each field of a record class, in order."""
    hints = typing.get_type_hints(record)
    return tuple(_accepted(hints[name]) for name in record._fields)


def required_fields(record: Any) -> int:
    """How many fields a sender must write (the rest have defaults)."""
    return len(record._fields) - len(record._field_defaults)


_NoneType = type(None)

# header -> the allowed types of each field after the header, in order.
MESSAGE_FIELDS: Final[dict[Header, FieldTypes]] = {
    header: field_types(record) for header, record in RECORDS.items()
}
# Fields a sender must write: those added later (with defaults in the record) may be left out.
_REQUIRED_FIELDS: Final = {header: required_fields(record) for header, record in RECORDS.items()}
# The batched messages: their one field is a list of these entry records.
ENTRIES: Final[dict[Header, Any]] = {
    Header.SUBMIT_REQUESTS: SubmitRequest,
    Header.ENGINE_REQUESTS: EngineRequest,
    Header.ENGINE_REPLY: EngineUpdate,
    Header.RESULTS: ClientResult,
    Header.STREAM: ClientChunk,
}
_ENTRY_SHAPES: Final = {
    header: (f"{header.name} entry", entry, field_types(entry), required_fields(entry))
    for header, entry in ENTRIES.items()
}
# KV_EVENTS: its last field is a list of KvEvent entries (the others say whose and which).
_KV_EVENT_SHAPE: Final = (
    "KV_EVENTS event",
    KvEvent,
    field_types(KvEvent),
    required_fields(KvEvent),
)
# The defaults of records that have some, in field order: ``encode`` leaves them off the end.
_TRAILING_DEFAULTS: Final = {
    record: tuple(record._field_defaults.values())
    for record in RECORDS.values()
    if record._field_defaults
}

_packer = msgpack.Packer(use_bin_type=True)
_HEADERS: Final = {int(h): h for h in Header}  # a dict lookup is ~5x cheaper than Header(n)
_HEADER_NUMBERS: Final = {record: int(header) for header, record in RECORDS.items()}
_new_tuple = tuple.__new__


def header_of(record: Any) -> Header:
    """The header a record is sent under."""
    return HEADER_OF[type(record)]


def encode(record: Any) -> bytes:
    """Serialize one message record as ``[header, *record]``. Trailing fields still at their
    default are left off (they were added after protocol version 1, and a peer of that
    version reads the message). Fields are not checked here: senders are our own code."""
    fields: Sequence[Any] = record
    defaults = _TRAILING_DEFAULTS.get(type(record))
    if defaults is not None:
        fields = _without_trailing_defaults(record, defaults)
    packed: bytes = _packer.pack([_HEADER_NUMBERS[type(record)], *fields])  # msgpack is untyped
    return packed


def encode_entry(record: Any) -> bytes:
    """One entry of a batched message (``ENTRIES``), packed alone: ``encode_batch`` joins
    entries packed ahead (a client packs each request as it is submitted, to refuse what cannot
    be sent at once, and sends them together later without packing them again)."""
    fields: Sequence[Any] = record
    defaults = _TRAILING_DEFAULTS.get(type(record))
    if defaults is not None:
        fields = _without_trailing_defaults(record, defaults)
    packed: bytes = _packer.pack(list(fields))
    return packed


def encode_batch(header: Header, entries: Sequence[bytes]) -> bytes:
    """``[header, [entry, ...]]`` from entries packed by ``encode_entry``: the batch record's
    message, as ``decode`` reads it."""
    return b"".join(
        (
            _packer.pack_array_header(2),
            _packer.pack(int(header)),
            _packer.pack_array_header(len(entries)),
            *entries,
        )
    )


def _without_trailing_defaults(record: tuple[Any, ...], defaults: tuple[Any, ...]) -> list[Any]:
    fields = list(record)
    required = len(fields) - len(defaults)
    while len(fields) > required and fields[-1] == defaults[len(fields) - required - 1]:
        fields.pop()
    return fields


def decode(payload: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Parse and check one message into its record (entries of a batched message into their
    entry records); raise ``ProtocolError`` for anything malformed."""
    if len(payload) > max_bytes:
        raise MessageTooLarge(len(payload), max_bytes, *_peek_reference(payload))
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"not a MessagePack message: {exc}") from None
    if not isinstance(message, list) or not message:
        raise ProtocolError("a message must be a non-empty MessagePack array [header, ...]")
    raw_header = message[0]
    if type(raw_header) is not int:
        raise ProtocolError(f"header must be an integer, got {type(raw_header).__name__}")
    header = _HEADERS.get(raw_header)
    if header is None:
        raise ProtocolError(f"unknown header {raw_header}")
    fields = message[1:]
    check_fields(header.name, fields, MESSAGE_FIELDS[header], _REQUIRED_FIELDS[header])
    shape = _ENTRY_SHAPES.get(header)
    if shape is not None:
        fields = [_entries(fields[0], *shape)]
    elif header is Header.KV_EVENTS:
        fields = [*fields[:3], _entries(fields[3], *_KV_EVENT_SHAPE)]
    return _record(RECORDS[header], fields)


def _record(record: Any, fields: list[Any]) -> Any:
    if len(fields) == len(record._fields):
        return _new_tuple(record, fields)  # what NamedTuple._make does, without a call
    return record(*fields)  # a trailing field left out takes its default


def _entries(
    entries: list[Any], what: str, entry: Any, types: FieldTypes, required: int
) -> list[Any]:
    """The entries of a batched message, checked, as records."""
    records = []
    for fields in entries:
        if not isinstance(fields, list):
            raise ProtocolError(f"each {what} must be an array")
        check_fields(what, fields, types, required)
        records.append(_record(entry, fields))
    return records


def _peek_reference(payload: bytes) -> tuple[int | None, int | None]:
    """The header and first field of a message, when both are integers, from its first bytes
    (an array header and two integers take at most 19 bytes); ``(None, None)`` otherwise."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(payload[:32])
    try:
        if unpacker.read_array_header() < 2:
            return None, None
        header, reference = unpacker.unpack(), unpacker.unpack()
    except Exception:  # anything that is not [int, int, ...] has no reference to answer
        return None, None
    if type(header) is not int or type(reference) is not int:
        return None, None
    return header, reference


def check_fields(
    what: str, fields: Sequence[object], types: FieldTypes, required: int | None = None
) -> None:
    """Raise ``ProtocolError`` unless ``fields`` holds ``len(types)`` items of those types, or,
    when ``required`` is given, at least that many (the first ones)."""
    count = len(fields)
    required = len(types) if required is None else required
    # Fast path first (this runs for every message); no field of any message is a bool, and a
    # flag where a number belongs (bool is an int subclass) is still a malformed message.
    if (
        required <= count <= len(types)
        and all(map(isinstance, fields, types))
        and bool not in set(map(type, fields))
    ):
        return
    if not required <= count <= len(types):
        expected = f"{required}-{len(types)}" if required < len(types) else f"{len(types)}"
        raise ProtocolError(f"{what} takes {expected} field(s), got {count}")
    for index, (value, allowed) in enumerate(zip(fields, types, strict=False)):
        if not isinstance(value, allowed) or type(value) is bool:
            names = "/".join("nil" if t is _NoneType else t.__name__ for t in allowed)
            raise ProtocolError(
                f"{what} field {index + 1} must be {names}, got {type(value).__name__}"
            )


_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack(typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    packed = array(typecode, values)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, what: str, data: bytes | bytearray) -> list[Any]:
    if len(data) % 4:
        raise ProtocolError(f"packed {what} must be a multiple of 4 bytes, got {len(data)}")
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE_ENDIAN:
        values.byteswap()
    return values.tolist()


TOKEN_BYTES: Final = 4  # one packed token id (int32)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes."""
    return _pack("i", tokens)


def unpack_tokens(data: bytes | bytearray) -> list[int]:
    """Inverse of ``pack_tokens``; raises ``ProtocolError`` for a length that is not 4k."""
    return _unpack("i", "tokens", data)


def pack_floats(values: Sequence[float]) -> bytes:
    """Log-probs as little-endian float32 bytes."""
    return _pack("f", values)


def unpack_floats(data: bytes | bytearray) -> list[float]:
    return _unpack("f", "floats", data)


def pack_logprobs(
    logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None
) -> bytes:
    """Log-probs and, with ``top``, each token's alternatives: per token a float32 log-prob then
    ``k`` (int32 token, float32 log-prob) pairs, ``k`` the request's ``top_logprobs``. With no
    alternatives this is ``pack_floats``; entries concatenate (updates append to each other)."""
    if not top:
        return pack_floats(logprobs)
    if len(top) != len(logprobs):
        raise ValueError(f"{len(top)} alternative lists for {len(logprobs)} log-probs")
    k = len(top[0])
    if any(len(entry) != k for entry in top):
        raise ValueError("every token needs the same number of alternatives")
    flat: list[float | int] = []
    for logprob, entry in zip(logprobs, top, strict=True):
        flat.append(logprob)
        for token, alternative in entry:
            flat += (token, alternative)
    packed = struct.pack("<" + ("f" + "if" * k) * len(logprobs), *flat)
    return packed


def unpack_logprobs(
    data: bytes | bytearray, k: int
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """Inverse of ``pack_logprobs`` for ``k`` alternatives per token (``ProtocolError`` if the
    length does not fit)."""
    if k == 0:
        return unpack_floats(data), None
    size = 4 + 8 * k
    if len(data) % size:
        raise ProtocolError(f"packed log-probs with {k} alternatives must be {size}k bytes")
    count = len(data) // size
    values = struct.unpack("<" + ("f" + "if" * k) * count, data)
    logprobs, top = [], []
    stride = 1 + 2 * k
    for start in range(0, len(values), stride):
        logprobs.append(values[start])
        top.append([(values[start + 1 + 2 * i], values[start + 2 + 2 * i]) for i in range(k)])
    return logprobs, top
