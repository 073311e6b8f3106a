"""Chained content hashes of token blocks: the keys of the prefix cache.

Block i's hash covers its tokens *and* block i-1's hash, so equal hashes mean equal prefixes up
to and including that block — the property that lets a lookup stop at the first miss.

    root     = BLAKE2b-128(person="kvd-root-v1", salt_bytes)
    hash[0]  = BLAKE2b-128(person="kvd-block-v1", parent or root ‖ tokens[0:B] as uint32 LE)
    hash[i]  = BLAKE2b-128(person="kvd-block-v1", hash[i-1] ‖ tokens[iB:(i+1)B] as uint32 LE)

* Deterministic across processes, restarts and hosts: a fixed byte encoding (little-endian
  uint32 token ids) and a keyed cryptographic hash — never Python's salted `hash()`.
* Versioned: the version is in the personalisation string; a change of scheme changes
  `HASH_VERSION` and every hash, so old and new caches can never confuse each other's blocks.
* `salt` separates namespaces that must not share blocks with equal tokens (another model,
  adapter, tenant or block geometry).
* 128 bits: a cache of 10^12 blocks has a collision chance near 10^-15. The daemon only serves
  processes of its own user, who could write any block anyway, so adversarial collisions buy
  nothing that would need a 256-bit digest.
* Partial trailing blocks get no hash: only full blocks are shareable.
Cost: bench/hashing.py (ns per token, against a SHA-256 chain like vLLM's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvd.errors import BadArgsError

HASH_VERSION = 1
DIGEST_NBYTES = 16
_ROOT_PERSON = b"kvd-root-v1"
_BLOCK_PERSON = b"kvd-block-v1"


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes: what is hashed and what goes on the wire."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise BadArgsError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    if tokens.size == 0:
        return b""
    if tokens.dtype.kind not in "iu":
        raise BadArgsError(f"token_ids must be integers, got dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() > 0xFFFFFFFF:
        raise BadArgsError("token ids must lie in [0, 2**32)")
    return tokens.astype("<u4", copy=False).tobytes()


def root_hash(salt: bytes = b"") -> bytes:
    """The parent of a sequence's first block for namespace `salt`."""
    return hashlib.blake2b(salt, digest_size=DIGEST_NBYTES, person=_ROOT_PERSON).digest()


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: bytes | None = None,
    salt: bytes = b"",
) -> list[bytes]:
    """Chained content hashes of every full block of `token_ids`.

    Args:
        token_ids: token ids in [0, 2**32).
        block_size: tokens per block (> 0).
        parent: hash of the block before `token_ids[0]` (to continue a chain); None starts one.
        salt: namespace bytes mixed into the root (ignored when `parent` is given).
    Returns:
        One 16-byte digest per full block; a partial tail block is not hashed.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise BadArgsError(f"block_size must be a positive int, got {block_size!r}")
    if parent is not None and not isinstance(parent, bytes):
        raise BadArgsError(f"parent must be bytes or None, got {type(parent).__name__}")
    if not isinstance(salt, bytes):
        raise BadArgsError(f"salt must be bytes, got {type(salt).__name__}")
    data = token_bytes(token_ids)
    block_nbytes = 4 * block_size
    num_full = len(data) // block_nbytes
    previous = root_hash(salt) if parent is None else parent
    blake2b = hashlib.blake2b
    view = memoryview(data)
    hashes = []
    for i in range(num_full):
        h = blake2b(previous, digest_size=DIGEST_NBYTES, person=_BLOCK_PERSON)
        h.update(view[i * block_nbytes:(i + 1) * block_nbytes])
        previous = h.digest()
        hashes.append(previous)
    return hashes
