from __future__ import annotations

import re
from pathlib import Path

import msgpack
import pytest

from dpserve import protocol
from dpserve.protocol import ControlState, EngineUpdate, Header, ProtocolError

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


def test_every_message_round_trips() -> None:
    samples = {
        bytes: b"\x01\x00\x00\x00",
        str: "text",
        int: 7,
        float: 0.5,
        list: [],
        dict: {"temperature": 0.0},
        type(None): None,
    }
    for header, types in protocol.MESSAGE_FIELDS.items():
        fields = [samples[allowed[0]] for allowed in types]
        decoded_header, decoded = protocol.decode(protocol.encode(header, *fields))
        assert decoded_header is header
        assert decoded == fields


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
    # A resubmission carries the tokens the client already has; a first submit need not.
    tokens = protocol.pack_tokens([1, 2])
    full = protocol.encode(Header.SUBMIT_REQUEST, 1, "hi", {}, tokens)
    assert protocol.decode(full) == (Header.SUBMIT_REQUEST, [1, "hi", {}, tokens])
    short = protocol.encode(Header.SUBMIT_REQUEST, 1, "hi", {})
    assert protocol.decode(short) == (Header.SUBMIT_REQUEST, [1, "hi", {}])
    assert protocol.decode_record(short).resume_tokens == b""
    with pytest.raises(ProtocolError, match="takes 3-4 field"):
        protocol.decode(protocol.encode(Header.SUBMIT_REQUEST, 1, "hi"))
    with pytest.raises(ProtocolError, match="field 4 must be bytes"):
        protocol.decode(protocol.encode(Header.SUBMIT_REQUEST, 1, "hi", {}, [1, 2]))


def test_size_limit_is_enforced_before_parsing() -> None:
    payload = protocol.encode(Header.SUBMIT_REQUEST, 1, "x" * 2000, {})
    assert protocol.decode(payload, max_bytes=4096)[0] is Header.SUBMIT_REQUEST
    with pytest.raises(ProtocolError, match="exceeds the 1024-byte limit"):
        protocol.decode(payload, max_bytes=1024)


def test_records_of_batched_messages_are_checked() -> None:
    fields, required = protocol.ENGINE_UPDATE_FIELDS, protocol.required_fields(EngineUpdate)
    without_text = [[1, b"", None, "length", None, 0.1]]
    with_text = [[1, b"a\x00\x00\x00", None, None, None, 0.1, "a"]]
    assert protocol.check_records("u", without_text, fields, required) == without_text
    assert protocol.check_records("u", with_text, fields, required) == with_text
    with pytest.raises(ProtocolError, match="takes 6-9 field"):
        protocol.check_records("u", [[1, b""]], fields, required)
    with pytest.raises(ProtocolError, match="takes 9 field"):
        protocol.check_records("u", without_text, fields)
    with pytest.raises(ProtocolError, match="must be an array"):
        protocol.check_records("u", [5], fields, required)
    with pytest.raises(ProtocolError, match="field 2 must be bytes"):
        protocol.check_records("u", [[1, "x", None, None, None, None]], fields, required)
    with pytest.raises(ProtocolError, match="field 7 must be str/nil"):
        protocol.check_records("u", [[1, b"", None, None, None, None, 5]], fields, required)


def test_records_encode_byte_identically_to_header_and_fields() -> None:
    samples = {bytes: b"\x01\x00\x00\x00", str: "text", int: 7, float: 0.5, list: [], dict: {}}
    for header, record_type in protocol.RECORDS.items():
        fields = [samples.get(allowed[0]) for allowed in protocol.field_types(record_type)]
        record = record_type(*fields)
        assert protocol.encode(record) == protocol.encode(header, *fields), header.name
        assert protocol.decode_record(protocol.encode(record)) == record
    update = EngineUpdate(3, b"", None, "stop", None, None, "text")
    reply = protocol.encode(protocol.EngineReply([update]))
    assert reply == protocol.encode(
        Header.ENGINE_REPLY, [[3, b"", None, "stop", None, None, "text", None, None]]
    )
    assert protocol.decode_record(reply).updates == [list(update)]


def test_control_states_are_the_wire_numbers() -> None:
    assert [int(s) for s in ControlState] == [0, 1, 2, 3]
    assert protocol.decode_record(
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
    for record in (EngineUpdate, protocol.ClientResult, protocol.StreamChunk):
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
