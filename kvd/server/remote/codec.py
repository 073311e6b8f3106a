"""The remote tier's names and bytes: the `--remote` URL, the key of a block, the value format.

Pure: no I/O, no redis import (the tier's threads do that, kvd/server/remote/tier.py).

Key of a sealed block (a Redis string key, ASCII)::

    kvd:{pool}:h{hash version}:g{geometry digest}:{block hash, hex}
    e.g. kvd:default:h1:g5c0fd3a1b2e94d07:8f3a...(32 hex digits)

* pool: the pool's name (a daemon's one pool is `default`): pools never meet.
* hash version: `kvd.hashing.HASH_VERSION`; a new hashing scheme never reads old blocks.
* geometry digest: BLAKE2b-64 of the geometry without `num_blocks` (layers, block size, heads,
  head dim, dtype, and whatever a geometry gains later): two pools of one name but different
  shapes never meet, and a value's bytes always fit the block they are copied into.
* Models are told apart as locally: by the salt mixed into the hash chain (kvd.hash_blocks'
  `salt`, seq_open's `salt`) or by the pool's name.
No hash tag (`{...}`): Redis Cluster spreads blocks over every slot, so a long prefix is
fetched from every master at once (redis-py splits an MGET by slot, kvd/server/remote/tier.py).

Value: a 32-byte header, the block hash again, then the block's bytes as they lie in the
segment (every layer's K and V, kvd/geometry.py)::

    offset size
     0      4   magic b"KVDB"
     4      1   value format version (FORMAT_VERSION)
     5      1   hash version
     6      1   hash length in bytes (K, at most 64)
     7      1   0
     8      8   geometry digest (the key's, as bytes)
    16      8   payload length in bytes, u64 little-endian (= the geometry's block_nbytes)
    24      4   CRC-32 of the payload, u32 little-endian (zlib.crc32: 20 us per 64 KiB)
    28      4   0
    32      K   the block hash
    32+K        payload

A value is served only if every field matches what the reader expects for the key it asked
(magic, both versions, geometry, hash, length, CRC): anything else is a miss, and the tier
deletes it. CRC-32 catches torn or truncated writes and bit rot, not an adversary: the tier is
trusted like the daemon's own uid (DESIGN.md section 5).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import numpy as np

from kvd.errors import BadArgsError
from kvd.geometry import Geometry
from kvd.hashing import HASH_VERSION

FORMAT_VERSION = 1
MAGIC = b"KVDB"
HEADER = struct.Struct("<4sBBBB8sQII")  # (the two reserved fields are 0: checked)
MAX_HASH_NBYTES = 64
MAX_VALUE_NBYTES = 512 << 20  # Redis' largest string (proto-max-bulk-len's default)
SCHEMES = ("redis", "redis-cluster")
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class RemoteURL:
    """A parsed `--remote`: one server (`redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`) or cluster
    seed nodes (`redis-cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]`). The password
    never appears in `str()` (stats, logs)."""

    is_cluster: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        nodes = ",".join(f"{host}:{port}" for host, port in self.nodes)
        if self.is_cluster:
            return f"redis-cluster://{nodes}"
        return f"redis://{nodes}/{self.db}"


def parse_url(text: str) -> RemoteURL:
    """Parse `--remote`. Raises BadArgsError naming the expected forms."""
    usage = ("--remote takes redis://HOST:PORT[/DB] or "
             "redis-cluster://HOST:PORT[,HOST:PORT...]")
    scheme, _, rest = text.partition("://")
    if scheme not in SCHEMES or not rest:
        raise BadArgsError(f"{usage}, got {text!r}")
    netloc, _, path = rest.partition("/")
    credentials, _, netloc = netloc.rpartition("@")
    user, _, secret = credentials.partition(":")
    username, password = unquote(user) or None, unquote(secret) or None
    nodes = tuple(_node(item, usage) for item in netloc.split(","))
    if scheme == "redis-cluster":
        if path:
            raise BadArgsError(f"a Redis Cluster has no databases: drop /{path} ({usage})")
        return RemoteURL(True, nodes, 0, username, password)
    if len(nodes) != 1:
        raise BadArgsError(f"redis:// names one server; for several use redis-cluster:// "
                           f"({usage})")
    if path and not path.isdigit():
        raise BadArgsError(f"the database must be a number, got {path!r} ({usage})")
    return RemoteURL(False, nodes, int(path or 0), username, password)


def _node(text: str, usage: str) -> tuple[str, int]:
    try:
        split = urlsplit(f"//{text}")
        host, port = split.hostname, split.port
    except ValueError:
        host = port = None
    if not host:
        raise BadArgsError(f"bad node {text!r}: {usage}")
    return host, port or DEFAULT_PORT


def geometry_digest(geometry: Geometry) -> bytes:
    """8 bytes naming a block's shape and dtype (the geometry less num_blocks)."""
    shape = {k: v for k, v in geometry.to_dict().items() if k != "num_blocks"}
    text = json.dumps(shape, sort_keys=True).encode()
    return hashlib.blake2b(text, digest_size=8, person=b"kvd-geometry").digest()


def check_block(pool: str, geometry: Geometry) -> None:
    """A typed error where a block of the pool would not fit in one Redis value."""
    if HEADER.size + MAX_HASH_NBYTES + geometry.block_nbytes > MAX_VALUE_NBYTES:
        raise BadArgsError(f"pool {pool!r}: its {geometry.block_nbytes}-byte blocks do not fit "
                           f"a Redis value ({MAX_VALUE_NBYTES >> 20} MiB) for --remote: lower "
                           "its block-size, or split its layers over two pools")


class Blocks(Protocol):
    """A pool's blocks as rows of bytes, `blocks[block_id]` (uint8 [block_nbytes]): a segment's
    one pool as an array, or a pool's blocks in the slabs it shares with others."""

    def __getitem__(self, block_id: int, /) -> Any: ...

    def __setitem__(self, block_id: int, value: Any, /) -> None: ...


class BlockCodec:
    """Keys and values of one pool's blocks (module docstring)."""

    def __init__(self, pool_name: str, geometry: Geometry) -> None:
        self.geometry_digest = geometry_digest(geometry)
        self.block_nbytes = geometry.block_nbytes
        self.prefix = f"kvd:{pool_name}:h{HASH_VERSION}:g{self.geometry_digest.hex()}:"

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    def encode(self, block_hash: bytes, block: np.ndarray) -> bytearray:
        """The value of a block whose bytes are `block` (copied once, then checksummed)."""
        head_nbytes = HEADER.size + len(block_hash)
        value = bytearray(head_nbytes + self.block_nbytes)
        payload = memoryview(value)[head_nbytes:]
        payload[:] = block.data.cast("B")
        HEADER.pack_into(value, 0, MAGIC, FORMAT_VERSION, HASH_VERSION, len(block_hash), 0,
                         self.geometry_digest, self.block_nbytes, zlib.crc32(payload), 0)
        value[HEADER.size:head_nbytes] = block_hash
        return value

    def payload(self, block_hash: bytes, value: bytes) -> memoryview | None:
        """The block bytes of `value`, or None if any check fails (module docstring)."""
        head_nbytes = HEADER.size + len(block_hash)
        if len(value) != head_nbytes + self.block_nbytes:
            return None
        (magic, version, hash_version, hash_nbytes, reserved, digest, nbytes, crc,
         reserved2) = HEADER.unpack_from(value)
        payload = memoryview(value)[head_nbytes:]
        if (magic != MAGIC or version != FORMAT_VERSION or hash_version != HASH_VERSION
                or hash_nbytes != len(block_hash) or reserved or reserved2
                or digest != self.geometry_digest
                or nbytes != self.block_nbytes or value[HEADER.size:head_nbytes] != block_hash
                or zlib.crc32(payload) != crc):
            return None
        return payload
