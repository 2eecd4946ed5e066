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

import sys
from array import array
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Final

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

    # Requests and results (20-39).
    SUBMIT_REQUEST = 20
    ENGINE_REQUEST = 21
    ENGINE_REPLY = 22
    RESULTS = 23
    STREAM = 24
    CANCEL = 25

    # Control signals, relayed to every engine and acknowledged (40-59).
    PAUSE = 40
    UNPAUSE = 41
    SUSPEND = 42
    RESUME = 43
    STOP = 44
    CONTROL_ACK = 45

    # Introspection (60-69).
    STATUS = 60
    STATUS_REPLY = 61

    # Errors (90-99).
    ERROR = 90


CONTROL_SIGNALS: Final = frozenset(
    {Header.PAUSE, Header.UNPAUSE, Header.SUSPEND, Header.RESUME, Header.STOP}
)


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


_NoneType = type(None)
_INT = (int,)
_STR = (str,)
_BYTES = (bytes,)
_LIST = (list,)
_DICT = (dict,)
_FLOAT = (float, int)
_OPT_INT = (int, _NoneType)
_OPT_STR = (str, _NoneType)
_OPT_BYTES = (bytes, _NoneType)
_OPT_FLOAT = (float, int, _NoneType)
_PROMPT = (str, bytes, list)

# header -> the allowed types of each field after the header, in order.
MESSAGE_FIELDS: Final[dict[Header, tuple[tuple[type, ...], ...]]] = {
    Header.CONNECT: (_INT,),  # protocol version
    Header.CONNECT_ACK: (_STR, _INT),  # coordinator instance id, protocol version
    Header.REGISTER: (_INT, _INT, _STR),  # rank, capacity, engine instance id
    Header.REGISTER_ACK: (_STR, _INT),  # coordinator instance id, control state
    Header.HEARTBEAT: (_INT,),  # requests held by the sender (0 for clients)
    Header.HEARTBEAT_ACK: (_STR,),  # coordinator instance id
    Header.DRAIN: (),
    Header.DRAIN_ACK: (),
    Header.DEREGISTER: (),
    Header.SUBMIT_REQUEST: (_INT, _PROMPT, _DICT),  # client request id, prompt, sampling params
    # request id, prompt tokens, sampling params, tokens already generated elsewhere
    Header.ENGINE_REQUEST: (_INT, _BYTES, _DICT, _BYTES),
    Header.ENGINE_REPLY: (_LIST,),  # [EngineUpdate fields, ...]
    Header.RESULTS: (_LIST,),  # [ClientResult fields, ...]
    Header.STREAM: (_LIST,),  # [[client request id, tokens, text], ...]
    Header.CANCEL: (_INT,),  # client request id (client->coordinator), request id (->engine)
    Header.PAUSE: (_INT,),  # control id
    Header.UNPAUSE: (_INT,),
    Header.SUSPEND: (_INT,),
    Header.RESUME: (_INT,),
    Header.STOP: (_INT,),
    Header.CONTROL_ACK: (_INT, _INT),  # signal header, control id
    Header.STATUS: (_INT,),  # query id
    Header.STATUS_REPLY: (_INT, _DICT),  # query id, status
    Header.ERROR: (_OPT_INT, _STR, _STR),  # request or control id (or nil), code, message
}

# One entry of ENGINE_REPLY: what an engine produced for one request since its last update.
# request id, new tokens, their log-probs (float32 bytes) or nil, finish reason or nil,
# error message or nil, engine-side seconds to first token or nil.
ENGINE_UPDATE_FIELDS: Final = (_INT, _BYTES, _OPT_BYTES, _OPT_STR, _OPT_STR, _OPT_FLOAT)

# One entry of RESULTS: a finished request as the client receives it.
# client request id, prompt tokens, generated tokens, text, finish reason, log-probs or nil,
# seconds to first token (measured by coordinator + engine) or nil, engine rank.
CLIENT_RESULT_FIELDS: Final = (_INT, _BYTES, _BYTES, _STR, _STR, _OPT_BYTES, _OPT_FLOAT, _INT)

# One entry of STREAM: client request id, new tokens, their text.
STREAM_CHUNK_FIELDS: Final = (_INT, _BYTES, _STR)

_packer = msgpack.Packer(use_bin_type=True)
_HEADERS: Final = {int(h): h for h in Header}  # a dict lookup is ~5x cheaper than Header(n)


def encode(header: Header, *fields: Any) -> bytes:
    """Serialize one message. Fields are not checked here: senders are our own code."""
    return _packer.pack([int(header), *fields])


def decode(payload: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[Header, list]:
    """Parse and check one message; raise ``ProtocolError`` for anything malformed."""
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
    check_fields(header.name, fields, MESSAGE_FIELDS[header])
    return header, fields


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


def check_fields(what: str, fields: Sequence, types: tuple[tuple[type, ...], ...]) -> None:
    """Raise ``ProtocolError`` unless ``fields`` has exactly ``len(types)`` items of those types."""
    # Fast path first (this runs for every message); no field of any message is a bool, and a
    # flag where a number belongs (bool is an int subclass) is still a malformed message.
    if (
        len(fields) == len(types)
        and all(map(isinstance, fields, types))
        and bool not in set(map(type, fields))
    ):
        return
    if len(fields) != len(types):
        raise ProtocolError(f"{what} takes {len(types)} field(s), got {len(fields)}")
    for index, (value, allowed) in enumerate(zip(fields, types, strict=True)):
        if not isinstance(value, allowed) or type(value) is bool:
            names = "/".join("nil" if t is _NoneType else t.__name__ for t in allowed)
            raise ProtocolError(
                f"{what} field {index + 1} must be {names}, got {type(value).__name__}"
            )


def check_records(what: str, records: list, types: tuple[tuple[type, ...], ...]) -> list[list]:
    """Check every record of a batched message (ENGINE_REPLY, RESULTS, STREAM)."""
    for record in records:
        if not isinstance(record, list):
            raise ProtocolError(f"each {what} record must be an array")
        check_fields(what, record, types)
    return records


_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack(typecode: str, values: Sequence) -> bytes:
    packed = array(typecode, values)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, what: str, data: bytes) -> list:
    if len(data) % 4:
        raise ProtocolError(f"packed {what} must be a multiple of 4 bytes, got {len(data)}")
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE_ENDIAN:
        values.byteswap()
    return values.tolist()


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes."""
    return _pack("i", tokens)


def unpack_tokens(data: bytes) -> list[int]:
    """Inverse of ``pack_tokens``; raises ``ProtocolError`` for a length that is not 4k."""
    return _unpack("i", "tokens", data)


def pack_floats(values: Sequence[float]) -> bytes:
    """Log-probs as little-endian float32 bytes."""
    return _pack("f", values)


def unpack_floats(data: bytes) -> list[float]:
    return _unpack("f", "floats", data)
