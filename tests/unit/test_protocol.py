from __future__ import annotations

import re
from pathlib import Path

import msgpack
import pytest

from dpserve import protocol
from dpserve.protocol import ControlState, EngineUpdate, Header, ProtocolError, SubmitRequest

DOCS = Path(__file__).parents[2] / "docs" / "protocol.md"


def test_header_numbers_are_stable_and_grouped() -> None:
    # Wire compatibility: these numbers must never change.
    assert Header.CONNECT == 1 and Header.REGISTER == 3 and Header.HEARTBEAT == 5
    assert Header.SUBMIT_REQUEST == 20 and Header.ENGINE_REPLY == 22 and Header.RESULTS == 23
    assert Header.PAUSE == 40 and Header.STOP == 44 and Header.CONTROL_ACK == 45
    assert Header.ERROR == 90
    assert set(protocol.MESSAGE_FIELDS) == set(Header), "every header needs a shape"
    groups = {h: h // 20 for h in Header}
    assert all(groups[h] == 2 for h in protocol.CONTROL_SIGNALS)


SAMPLES = {
    bytes: b"\x01\x00\x00\x00",
    str: "text",
    int: 7,
    float: 0.5,
    list: [],
    dict: {"temperature": 0.0},
    type(None): None,
}


def test_every_message_round_trips_as_its_record() -> None:
    for header, record_type in protocol.RECORDS.items():
        fields = [SAMPLES[allowed[0]] for allowed in protocol.field_types(record_type)]
        record = record_type(*fields)
        payload = protocol.encode(record)
        assert msgpack.unpackb(payload)[0] == int(header), header.name
        decoded = protocol.decode(payload)
        assert type(decoded) is record_type and decoded == record, header.name
        assert protocol.header_of(decoded) is header


def test_batched_messages_decode_into_entry_records() -> None:
    update = EngineUpdate(3, b"", None, "stop", None, None, "text")
    reply = protocol.encode(protocol.EngineReply([update]))
    assert msgpack.unpackb(reply) == [
        int(Header.ENGINE_REPLY),
        [[3, b"", None, "stop", None, None, "text", None, None, None, None]],
    ]
    (decoded,) = protocol.decode(reply).updates
    assert type(decoded) is EngineUpdate and decoded == update
    result = protocol.ClientResult(1, b"", b"", "", "stop", None, None, 0)
    assert protocol.decode(protocol.encode(protocol.Results([result]))).results == [result]
    chunk = protocol.ClientChunk(1, b"", "x")
    (got,) = protocol.decode(protocol.encode(protocol.Stream([chunk]))).chunks
    assert type(got) is protocol.ClientChunk and got == chunk


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not a MessagePack"),
        (msgpack.packb({"a": 1}), "non-empty MessagePack array"),
        (msgpack.packb([]), "non-empty MessagePack array"),
        (msgpack.packb(["1"]), "header must be an integer"),
        (msgpack.packb([999]), "unknown header 999"),
        (msgpack.packb([True]), "header must be an integer"),
        (msgpack.packb([Header.CONNECT]), "takes 1 field"),
        (msgpack.packb([Header.CONNECT, 1, 2]), "takes 1 field"),
        (msgpack.packb([Header.CONNECT, "1"]), "must be int"),
        (msgpack.packb([Header.HEARTBEAT, True]), "must be int"),
        (msgpack.packb([Header.SUBMIT_REQUEST, 1, 5, {}]), "must be str/bytes/list"),
        (msgpack.packb([Header.ERROR, None, "code", None]), "must be str"),
    ],
)
def test_malformed_messages_raise_protocol_error(payload: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        protocol.decode(payload)


def test_optional_trailing_fields_may_be_left_out() -> None:
    # A resubmission carries the tokens the client already has; a first submit need not, and
    # encode leaves a field at its default off, so a peer of protocol version 1 reads it.
    tokens = protocol.pack_tokens([1, 2])
    full = protocol.encode(SubmitRequest(1, "hi", {}, tokens))
    assert msgpack.unpackb(full) == [int(Header.SUBMIT_REQUEST), 1, "hi", {}, tokens]
    assert protocol.decode(full) == SubmitRequest(1, "hi", {}, tokens)
    short = protocol.encode(SubmitRequest(1, "hi", {}))
    assert msgpack.unpackb(short) == [int(Header.SUBMIT_REQUEST), 1, "hi", {}]
    assert protocol.decode(short).resume_tokens == b""
    assert msgpack.unpackb(protocol.encode(protocol.Heartbeat(0))) == [int(Header.HEARTBEAT), 0]
    assert msgpack.unpackb(protocol.encode(protocol.Heartbeat(0, {}))) == [
        int(Header.HEARTBEAT),
        0,
        {},
    ]
    with pytest.raises(ProtocolError, match="takes 3-4 field"):
        protocol.decode(msgpack.packb([int(Header.SUBMIT_REQUEST), 1, "hi"]))
    with pytest.raises(ProtocolError, match="field 4 must be bytes"):
        protocol.decode(msgpack.packb([int(Header.SUBMIT_REQUEST), 1, "hi", {}, [1, 2]]))


def test_size_limit_is_enforced_before_parsing() -> None:
    payload = protocol.encode(SubmitRequest(1, "x" * 2000, {}))
    assert isinstance(protocol.decode(payload, max_bytes=4096), SubmitRequest)
    with pytest.raises(ProtocolError, match="exceeds the 1024-byte limit"):
        protocol.decode(payload, max_bytes=1024)


def _reply(*updates: object) -> bytes:
    return msgpack.packb([int(Header.ENGINE_REPLY), list(updates)])


def test_entries_of_batched_messages_are_checked() -> None:
    # An engine that predates the text field writes six fields: the text is then None.
    (without_text,) = protocol.decode(_reply([1, b"", None, "length", None, 0.1])).updates
    assert without_text == EngineUpdate(1, b"", None, "length", None, 0.1)
    (with_text,) = protocol.decode(
        _reply([1, b"a\x00\x00\x00", None, None, None, 0.1, "a"])
    ).updates
    assert with_text.text == "a"
    with pytest.raises(ProtocolError, match="ENGINE_REPLY entry takes 6-11 field"):
        protocol.decode(_reply([1, b""]))
    with pytest.raises(ProtocolError, match="must be an array"):
        protocol.decode(_reply(5))
    with pytest.raises(ProtocolError, match="field 2 must be bytes"):
        protocol.decode(_reply([1, "x", None, None, None, None]))
    with pytest.raises(ProtocolError, match="field 7 must be str/nil"):
        protocol.decode(_reply([1, b"", None, None, None, None, 5]))
    with pytest.raises(ProtocolError, match="RESULTS entry takes 8-12 field"):
        protocol.decode(msgpack.packb([int(Header.RESULTS), [[1, b"", b"", "", "stop"]]]))
    with pytest.raises(ProtocolError, match="STREAM entry field 3 must be str"):
        protocol.decode(msgpack.packb([int(Header.STREAM), [[1, b"", None]]]))


def test_control_states_are_the_wire_numbers() -> None:
    assert [int(s) for s in ControlState] == [0, 1, 2, 3]
    assert protocol.decode(
        protocol.encode(protocol.RegisterAck("i", ControlState.SUSPENDED))
    ) == protocol.RegisterAck("i", 2)


def test_the_protocol_page_lists_every_record_with_its_fields() -> None:
    rows = re.findall(
        r"^\| ?(\d*) \| ([A-Z_]+|\(entry\)) \| `(\w+)` \| (.+) \|$",
        DOCS.read_text(),
        flags=re.MULTILINE,
    )
    documented = {name: (number, header, fields) for number, header, name, fields in rows}
    expected = {}
    for header, record in protocol.RECORDS.items():
        expected[record.__name__] = (str(int(header)), header.name, _doc_fields(record))
    for record in (EngineUpdate, protocol.ClientResult, protocol.ClientChunk, protocol.KvEvent):
        expected[record.__name__] = ("", "(entry)", _doc_fields(record))
    assert documented == expected


def _doc_fields(record: type) -> str:
    names = [f"*{n}*" if n in record._field_defaults else n for n in record._fields]
    return ", ".join(names) or "—"


def test_token_and_float_packing() -> None:
    tokens = [0, 1, 255, 65_536, 2**31 - 1]
    assert protocol.unpack_tokens(protocol.pack_tokens(tokens)) == tokens
    assert protocol.pack_tokens([1]) == b"\x01\x00\x00\x00", "little-endian on the wire"
    assert protocol.unpack_floats(protocol.pack_floats([-0.5, -2.0])) == [-0.5, -2.0]
    with pytest.raises(ProtocolError, match="multiple of 4"):
        protocol.unpack_tokens(b"abc")


def test_a_batch_of_entries_packed_ahead_decodes_as_its_record() -> None:
    """``encode_entry`` + ``encode_batch`` (the client's SUBMIT_REQUESTS) read back as the
    batch record, trailing defaults filled in; CONNECT_ACK's batch size is optional."""
    entries = [
        protocol.SubmitRequest(1, "hi", {"temperature": 0}),
        protocol.SubmitRequest(2, b"\x01\x00\x00\x00", {}, b"\x02\x00\x00\x00"),
    ]
    payload = protocol.encode_batch(
        Header.SUBMIT_REQUESTS, [protocol.encode_entry(entry) for entry in entries]
    )
    assert protocol.decode(payload) == protocol.SubmitRequests(entries)
    old_ack = msgpack.packb([int(Header.CONNECT_ACK), "instance", 1])
    assert protocol.decode(old_ack) == protocol.ConnectAck("instance", 1, 0)
