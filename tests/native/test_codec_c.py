"""kvd/server/remote/_codec.c's MSET packing against BlockCodec.pack_mset's Python, its
specification: the same bytes on the wire for the same blocks, the same blocks left out when
their generation moved, and values that BlockCodec.payload accepts."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.geometry import Geometry
from kvd.server.remote import codec as codec_module
from kvd.server.remote.codec import BlockCodec

built = codec_module._built_codec
needs_codec = pytest.mark.skipif(built is None, reason="kvd/server/remote/_codec.c is not built "
                                 "here: only the Python runs")
GEOMETRY = Geometry(num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)


def test_the_c_module_is_built_where_ci_requires_it() -> None:
    if built is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/server/remote/_codec.c is not built here and KVD_REQUIRE_C is not set")
    assert built is not None, "KVD_REQUIRE_C=1 but kvd/server/remote/_codec.c was not built"


def python_pack(codec: BlockCodec, blocks: np.ndarray, generations: np.ndarray,
                rows: list[tuple[int, bytes, int]]) -> tuple[bytes, int]:
    saved, codec_module._codec = codec_module._codec, None
    try:
        command, start, num_values = codec.pack_mset(blocks, generations, rows)
    finally:
        codec_module._codec = saved
    return command[start:], num_values


def c_pack(codec: BlockCodec, blocks: np.ndarray, generations: np.ndarray,
           rows: list[tuple[int, bytes, int]]) -> tuple[bytes, int]:
    assert built is not None
    command, start, num_values = built.pack_mset(blocks, generations, rows,
                                                 codec.prefix.encode(), codec.head)
    return command[start:], num_values


def parse_mset(command: bytes) -> list[bytes]:
    """The arguments of one RESP command (a test's reader, not redis-py's)."""
    assert command[:1] == b"*"
    line_end = command.index(b"\r\n")
    count, position, args = int(command[1:line_end]), line_end + 2, []
    for _ in range(count):
        assert command[position:position + 1] == b"$"
        line_end = command.index(b"\r\n", position)
        nbytes = int(command[position + 1:line_end])
        args.append(command[line_end + 2:line_end + 2 + nbytes])
        assert command[line_end + 2 + nbytes:line_end + 4 + nbytes] == b"\r\n"
        position = line_end + 4 + nbytes
    assert position == len(command)
    return args


@needs_codec
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, GEOMETRY.num_blocks - 1),
                          st.binary(min_size=1, max_size=64), st.booleans()), max_size=12),
       st.integers(0, 2**64 - 2))
def test_c_packs_the_bytes_python_packs(picks: list[tuple[int, bytes, bool]], base: int) -> None:
    codec = BlockCodec("default", GEOMETRY)
    rng = np.random.default_rng(len(picks))
    blocks = rng.integers(0, 256, (GEOMETRY.num_blocks, GEOMETRY.block_nbytes), dtype=np.uint8)
    generations = np.full(GEOMETRY.num_blocks, base, dtype=np.uint64)
    rows = [(block_id, block_hash, base if current else base + 1)
            for block_id, block_hash, current in picks]
    command, num_values = c_pack(codec, blocks, generations, rows)
    assert (command, num_values) == python_pack(codec, blocks, generations, rows)
    kept = [row for row, (_, _, current) in zip(rows, picks) if current]
    args = parse_mset(command)
    assert args[0] == b"MSET" and num_values == len(kept) == (len(args) - 1) // 2
    for (block_id, block_hash, _), key, value in zip(kept, args[1::2], args[2::2]):
        assert key.decode() == codec.key(block_hash)
        assert codec.payload(block_hash, value) == blocks[block_id].tobytes()


@needs_codec
def test_c_declines_what_python_refuses() -> None:
    """One-sided (docs/native.md): C returns None, having done nothing, and the Python raises."""
    codec = BlockCodec("default", GEOMETRY)
    blocks = np.zeros((GEOMETRY.num_blocks, GEOMETRY.block_nbytes), dtype=np.uint8)
    generations = np.zeros(GEOMETRY.num_blocks, dtype=np.uint64)
    assert built is not None
    prefix = codec.prefix.encode()
    for rows, error in (([(GEOMETRY.num_blocks, b"h", 0)], IndexError),
                        ([(-1, b"h", 0)], ValueError)):
        assert built.pack_mset(blocks, generations, rows, prefix, codec.head) is None
        with pytest.raises(error):
            codec.pack_mset(blocks, generations, rows)
    bad_rows: list[list[Any]] = [[(0, "not bytes", 0)], [(0, b"x" * 65, 0)], [(0, b"h")],
                                 [(2**70, b"h", 0)]]
    for rows in bad_rows:
        assert built.pack_mset(blocks, generations, rows, prefix, codec.head) is None
    assert built.pack_mset(blocks, generations[:4], [], prefix, codec.head) is None
    assert built.pack_mset(blocks, generations, [], prefix, b"short") is None


@needs_codec
@pytest.mark.parametrize("length", [*range(0, 200), 4095, 4096, 65536, 65536 + 15, 1 << 20])
def test_c_crc32_is_zlibs(length: int) -> None:
    """The carry-less multiplication's folds and tails against zlib, on every short length."""
    import zlib

    assert built is not None
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert built.crc32(data) == zlib.crc32(data)
    assert built.crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])
