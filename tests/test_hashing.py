"""kvd.hash_blocks: deterministic, chained, salted, versioned; bad input is a BadArgsError."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvd
from kvd.errors import BadArgsError
from kvd.hashing import DIGEST_NBYTES, HASH_VERSION, hash_blocks, root_hash

TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=80)
BLOCK_SIZES = st.integers(1, 9)

# Known answers for HASH_VERSION 1. If these change, every cache built with the old scheme would
# silently stop matching: bump HASH_VERSION (and the personalisation strings) instead.
KNOWN_ANSWERS = [
    ((list(range(32)), 16, b""),
     ["021c3d67cf4bda40776ed0c7ffe51ece", "505f984478ca6d65bfd863fe2965b080"]),
    (([7] * 8, 4, b"model-a"),
     ["62e211ea7d49393323d5ee3354dc8cc1", "48a97b06f5596f0d5e2c7936f8e58e63"]),
]


@pytest.mark.parametrize("args, expected", KNOWN_ANSWERS)
def test_known_answer_vectors_pin_the_scheme(args, expected):
    tokens, block_size, salt = args
    assert HASH_VERSION == 1
    assert [h.hex() for h in hash_blocks(tokens, block_size, salt=salt)] == expected


def test_scheme_matches_its_documentation():
    """Re-derive block hashes from the module docstring's formula with hashlib alone."""
    tokens, block_size, salt = list(range(32)), 16, b"s"
    previous = hashlib.blake2b(salt, digest_size=16, person=b"kvd-root-v1").digest()
    expected = []
    for start in range(0, len(tokens), block_size):
        payload = previous + np.array(tokens[start:start + block_size], "<u4").tobytes()
        previous = hashlib.blake2b(payload, digest_size=16, person=b"kvd-block-v1").digest()
        expected.append(previous)
    assert hash_blocks(tokens, block_size, salt=salt) == expected


def test_deterministic_across_processes_with_different_hash_seeds():
    code = ("import kvd; print(','.join(h.hex() for h in "
            "kvd.hash_blocks(list(range(100)), 16, salt=b'x')))")
    outputs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True, timeout=60)
        outputs.add(result.stdout.strip())
    here = ",".join(h.hex() for h in hash_blocks(list(range(100)), 16, salt=b"x"))
    assert outputs == {here}


@settings(max_examples=200)
@given(tokens=TOKENS, block_size=BLOCK_SIZES, cut=st.integers(0, 80))
def test_prefix_property(tokens, block_size, cut):
    whole = hash_blocks(tokens, block_size)
    assert hash_blocks(tokens[:cut], block_size) == whole[:cut // block_size]


@settings(max_examples=200)
@given(tokens=TOKENS, block_size=BLOCK_SIZES, num_blocks=st.integers(1, 8), salt=st.binary())
def test_continuing_from_parent_equals_hashing_the_whole(tokens, block_size, num_blocks, salt):
    whole = hash_blocks(tokens, block_size, salt=salt)
    if len(whole) < num_blocks:
        return
    cut = num_blocks * block_size
    rest = hash_blocks(tokens[cut:], block_size, parent=whole[num_blocks - 1], salt=b"ignored")
    assert whole[:num_blocks] + rest == whole


def test_one_digest_per_full_block_and_partial_tail_not_hashed():
    hashes = hash_blocks(list(range(35)), 16)
    assert len(hashes) == 2 and all(len(h) == DIGEST_NBYTES for h in hashes)
    assert hashes == hash_blocks(list(range(32)), 16)
    assert hash_blocks(list(range(15)), 16) == [] and hash_blocks([], 16) == []


def test_changing_one_token_changes_its_block_and_every_later_block():
    tokens = list(range(48))
    changed = tokens.copy()
    changed[20] += 1
    before, after = hash_blocks(tokens, 16), hash_blocks(changed, 16)
    assert before[0] == after[0] and before[1] != after[1] and before[2] != after[2]


def test_chaining_separates_equal_blocks_with_different_prefixes():
    first = hash_blocks([1] * 4 + [9] * 4, 4)
    second = hash_blocks([2] * 4 + [9] * 4, 4)
    assert first[1] != second[1]
    assert hash_blocks([9] * 8, 4)[0] != hash_blocks([9] * 8, 4)[1]


def test_salt_separates_namespaces():
    tokens = list(range(32))
    assert hash_blocks(tokens, 16, salt=b"model-a") != hash_blocks(tokens, 16, salt=b"model-b")
    assert hash_blocks(tokens, 16, salt=b"") != hash_blocks(tokens, 16, salt=b"model-a")
    assert root_hash(b"a") != root_hash(b"b") and len(root_hash()) == DIGEST_NBYTES


def test_block_size_separates_hashes_of_the_same_tokens():
    tokens = list(range(32))
    assert hash_blocks(tokens, 16)[0] not in hash_blocks(tokens, 8)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64, np.uint16])
def test_token_container_and_dtype_do_not_matter(dtype):
    tokens = list(range(40))
    assert hash_blocks(np.array(tokens, dtype=dtype), 8) == hash_blocks(tokens, 8)
    assert hash_blocks(tuple(tokens), 8) == hash_blocks(tokens, 8)


def test_full_token_range_is_accepted():
    assert len(hash_blocks([0, 2**32 - 1], 2)) == 1


@pytest.mark.parametrize("tokens, match", [
    ([1, -1], r"\[0, 2\*\*32\)"),
    ([1, 2**32], r"\[0, 2\*\*32\)"),
    ([1, 2**70], "integers"),
    ([1.0, 2.0], "integers"),
    (np.array([1.5, 2.5]), "integers"),
    ([True, False], "integers"),
    (["1", "2"], "integers"),
    ([[1, 2], [3, 4]], "one-dimensional"),
    (np.zeros((2, 2), dtype=np.int64), "one-dimensional"),
    (7, "one-dimensional"),
])
def test_bad_tokens_are_bad_args(tokens, match):
    with pytest.raises(BadArgsError, match=match):
        hash_blocks(tokens, 2)


@pytest.mark.parametrize("block_size", [0, -16, 1.5, "16", None, True])
def test_bad_block_size_is_bad_args(block_size):
    with pytest.raises(BadArgsError, match="block_size must be a positive int"):
        hash_blocks([1, 2, 3, 4], block_size)


@pytest.mark.parametrize("kwargs, match", [
    ({"parent": "0123"}, "parent must be bytes"),
    ({"parent": 5}, "parent must be bytes"),
    ({"salt": "model"}, "salt must be bytes"),
])
def test_bad_parent_or_salt_is_bad_args(kwargs, match):
    with pytest.raises(BadArgsError, match=match):
        hash_blocks([1, 2], 2, **kwargs)


def test_exported_at_package_top():
    assert kvd.hash_blocks is hash_blocks and kvd.HASH_VERSION == HASH_VERSION
