"""kvd/protocol/framing.py on bytes alone: frames whole, byte by byte, split at every offset,
coalesced, and bad length prefixes (the bodies are msgpack, but nothing here decodes them)."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import ProtocolError, TooLargeError
from kvd.protocol.framing import MAX_FRAME_NBYTES, FrameBuffer, prefixed, whole_frames

MESSAGES = [
    [0, "hello", {"protocol_version": 1}],
    [7, "alloc", {"num_blocks": 3}],
    [2**64 - 1, "seal", {"block_ids": [1, 2, 3], "hashes": [b"\x00" * 16, b"\xff" * 16]}],
    [3, True, {"nested": {"ids": list(range(300)), "text": "é" * 100}}],
    [4, False, ["NO_SPACE", "pool is full: release blocks or raise --num-blocks"]],
    [5, "lookup", {"hashes": [bytes(range(16))] * 1000}],
]
BODIES = [msgpack.packb(message, use_bin_type=True) for message in MESSAGES]
FRAMES = [prefixed(body) for body in BODIES]
STREAM = b"".join(FRAMES)


def frame_of(message) -> bytes:
    return prefixed(msgpack.packb(message, use_bin_type=True))


def decode_all(chunks) -> list:
    decoder = FrameBuffer()
    bodies = [body for chunk in chunks for body in decoder.feed(chunk)]
    assert decoder.buffered_nbytes == 0
    return [msgpack.unpackb(body) for body in bodies]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: str(m[1]))
def test_each_message_whole_and_byte_by_byte(message):
    frame = frame_of(message)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert decode_all([frame]) == [message]
    assert decode_all([frame[i:i + 1] for i in range(len(frame))]) == [message]
    assert decode_all([memoryview(frame)]) == [message]


@pytest.mark.parametrize("message", MESSAGES[:5], ids=lambda m: str(m[1]))
def test_each_message_split_at_every_offset(message):
    frame = frame_of(message)
    for cut in range(len(frame) + 1):
        assert decode_all([frame[:cut], frame[cut:]]) == [message]


def test_many_frames_in_one_chunk_and_split_everywhere():
    assert decode_all([STREAM]) == MESSAGES
    for cut in range(0, len(STREAM), 7):
        assert decode_all([STREAM[:cut], STREAM[cut:]]) == MESSAGES


@pytest.mark.parametrize("num_trailing", [1, 3, 4, 5, 10])
def test_trailing_bytes_stay_buffered_until_completed(num_trailing):
    decoder = FrameBuffer()
    next_frame = FRAMES[1]
    bodies = decoder.feed(FRAMES[0] + next_frame[:num_trailing])
    assert [msgpack.unpackb(b) for b in bodies] == [MESSAGES[0]]
    assert decoder.buffered_nbytes == num_trailing
    bodies = decoder.feed(next_frame[num_trailing:])
    assert [msgpack.unpackb(b) for b in bodies] == [MESSAGES[1]]
    assert decoder.buffered_nbytes == 0


def test_zero_length_rejected_and_decoder_stays_failed():
    decoder = FrameBuffer()
    with pytest.raises(ProtocolError, match="length 0"):
        decoder.feed(b"\0\0\0\0")
    with pytest.raises(ProtocolError):
        decoder.feed(FRAMES[0])


def test_huge_length_rejected_before_the_body_arrives():
    decoder = FrameBuffer()
    prefix = struct.pack(">I", MAX_FRAME_NBYTES + 1)
    assert decoder.feed(prefix[:3]) == []
    with pytest.raises(TooLargeError, match="split the batch"):
        decoder.feed(prefix[3:])  # only the 4 prefix bytes were sent, no body
    with pytest.raises(TooLargeError):
        decoder.feed(b"x")


def test_huge_length_after_a_good_frame_in_the_same_chunk():
    with pytest.raises(TooLargeError):
        FrameBuffer().feed(FRAMES[0] + b"\xff\xff\xff\xff")


def test_frame_exactly_at_the_cap_passes_and_one_byte_more_is_refused():
    overhead = len(msgpack.packb(b"\0" * 70_000, use_bin_type=True)) - 70_000  # bin32 header
    at_cap = frame_of(b"\0" * (MAX_FRAME_NBYTES - overhead))
    assert len(at_cap) == 4 + MAX_FRAME_NBYTES
    decoder = FrameBuffer()
    bodies = [b for i in range(0, len(at_cap), 65536) for b in decoder.feed(at_cap[i:i + 65536])]
    assert len(bodies) == 1 and len(bodies[0]) == MAX_FRAME_NBYTES
    with pytest.raises(TooLargeError):
        frame_of(b"\0" * (MAX_FRAME_NBYTES - overhead + 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
def test_random_chunkings_give_the_same_frames(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in zip(bounds, bounds[1:])]
    assert decode_all(chunks) == MESSAGES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.lists(st.integers(min_value=1, max_value=8), max_size=16))
def test_garbage_stream_raises_only_kvd_errors(data, chunk_nbytes):
    decoder = FrameBuffer()
    position = 0
    try:
        for step in [*chunk_nbytes, len(data)]:
            for body in decoder.feed(data[position:position + step]):
                msgpack.unpackb(body)
            position += step
    except (ProtocolError, TooLargeError):
        pass



def test_whole_frames_are_the_bodies_of_a_chunk_of_whole_frames_only():
    assert [bytes(body) for body in whole_frames(STREAM)] == BODIES
    assert [bytes(body) for body in whole_frames(memoryview(FRAMES[1]))] == [BODIES[1]]
    for partial in (STREAM[:-1], STREAM + b"\0\0", STREAM + b"\0\0\0\0", b"", b"\0\0\0",
                    STREAM + struct.pack(">I", MAX_FRAME_NBYTES + 1)):
        assert whole_frames(partial) is None  # (feed() buffers it, or raises)


def test_prefixed_refuses_a_body_above_the_cap():
    assert prefixed(b"x") == b"\0\0\0\x01x"
    with pytest.raises(TooLargeError):
        prefixed(b"\0" * (MAX_FRAME_NBYTES + 1))
