"""Protobuf wire encoding by hand, for requests no generated class would write: a field with the wrong
wire type, a scalar twice, a packed field unpacked, unknown fields, invalid UTF-8, truncated bytes."""

import struct

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64 travel as 10-byte two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def record(number: int, wire_type: int, payload: bytes | int | float) -> bytes:
    """One field record: its tag and, by wire type, a varint, 8 or 4 fixed bytes, or length-prefixed bytes."""
    tag = varint(number << 3 | wire_type)
    if wire_type == VARINT:
        return tag + varint(payload)
    if wire_type == I64:
        return tag + struct.pack("<d", payload)
    if wire_type == I32:
        return tag + struct.pack("<f", payload)
    return tag + varint(len(payload)) + payload


def unpacked(number: int, values: list[int]) -> bytes:
    """A packed repeated varint field written as one record per value (parsers must accept both)."""
    return b"".join(record(number, VARINT, v) for v in values)


def wrapped(number: int, message: bytes) -> bytes:
    """`message` as the submessage field `number` of an enclosing message (e.g. SampleStreamRequest.sample)."""
    return record(number, LEN, message)
