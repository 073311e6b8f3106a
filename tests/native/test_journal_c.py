"""kvd/server/_journal.c against the Python it shortcuts (kvd/server/journal.py's record packing
and settling), which is its specification.

The contract is one-sided: whatever the C returns equals what the Python returns for the same
input, and where it returns None the Python runs instead. So every test here checks both halves:
agreement whenever C answers, and that C does answer for the rows that make up kvd's traffic.
"""

from __future__ import annotations

import os
from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvd import native
from kvd.server import journal

journal_c = native.built("journal")  # (tests call it directly: KVD_PURE_PYTHON only turns its use off)
needs_c = pytest.mark.skipif(journal_c is None, reason="kvd/server/_journal.c is not built here "
                             "(a plain source checkout or no C compiler): only the Python runs")
# For the tests of the journal's use of the module (use_c, commits).
in_use = pytest.mark.skipif(os.environ.get("KVD_PURE_PYTHON") == "1",
                            reason="KVD_PURE_PYTHON=1: kvd does not use kvd/server/_journal.c")


def test_the_c_module_is_built_where_ci_requires_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to Python fails there."""
    if journal_c is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/server/_journal.c is not built here and KVD_REQUIRE_C is not set")
    assert journal_c is not None, "KVD_REQUIRE_C=1 but kvd/server/_journal.c was not built"
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert journal._c is journal_c  # and the journal uses it


@needs_c
@in_use
def test_use_c_switches_the_journals_c_alone() -> None:
    from kvd import protocol

    codec = protocol.codec()
    try:
        assert journal.use_c(False) is False and journal._c is None
        assert protocol.codec() == codec  # the protocol has a switch of its own
        assert journal.use_c(True) is True and journal._c is journal_c
    finally:
        journal.use_c(True)


def same(a: Any, b: Any) -> bool:
    """Equal with equal types all the way down (True == 1 and (1,) == [1] are not enough)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def python_records(evictions: Any, seals: Any, first_seal_seq: Any) -> tuple[int, bytes] | None:
    try:
        return journal._records(evictions, seals, first_seal_seq)
    except Exception:  # struct.error, sqlite3.DataError, TypeError: what commit() would raise
        return None


block_ids = st.integers(min_value=-(2**31), max_value=2**31 - 1)
u64s = st.integers(min_value=0, max_value=2**64 - 1)
# The rows BlockPool.journal_rows makes: (block_id, key, generation, parent, parent_generation,
# tier), keys of any length the journal keeps.
journal_rows = st.tuples(block_ids, st.binary(max_size=journal.MAX_KEY_NBYTES), u64s, block_ids,
                         u64s, st.integers(min_value=0, max_value=255))
# And rows it would not pack: a field out of range or of another type, a list for a tuple.
odd_fields = st.one_of(st.integers(min_value=-(2**65), max_value=2**65), st.booleans(),
                       st.none(), st.binary(max_size=300), st.floats(), st.text(max_size=3))
odd_rows = st.one_of(
    journal_rows,
    st.tuples(odd_fields, odd_fields, odd_fields, odd_fields, odd_fields, odd_fields),
    journal_rows.map(list), st.tuples(block_ids, st.binary(max_size=16)),
    st.builds(lambda row, at, value: row[:at] + (value,) + row[at + 1:], journal_rows,
              st.integers(min_value=0, max_value=5), odd_fields))


def records_in_c(evictions: Any, seals: Any, first_seal_seq: Any) -> tuple[int, bytes] | None:
    return journal_c.journal_records(evictions, seals, first_seal_seq, journal.DEFAULT_KEY_WIDTH)


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(block_ids, max_size=20), st.lists(journal_rows, max_size=20), u64s)
def test_journal_records_pack_in_c_byte_for_byte_as_in_python(
        evictions: list[int], rows: list[tuple], first_seal_seq: int) -> None:
    """The usual rows always pack in C, to the Python path's bytes (evictions overlapping the
    seals included: those leave no tombstone)."""
    seals = {row[0]: row for row in rows}
    evictions += list(seals)[::2]
    assume(first_seal_seq + len(seals) <= 2**64)  # (seal_seq is a u64)
    expected = python_records(evictions, seals, first_seal_seq)
    assert expected is not None
    assert same(records_in_c(evictions, seals, first_seal_seq), expected)


@needs_c
@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(block_ids, odd_fields), max_size=8),
       st.dictionaries(st.one_of(block_ids, st.text(max_size=2)), odd_rows, max_size=8),
       st.one_of(u64s, odd_fields))
def test_any_rows_pack_in_c_as_in_python_or_not_at_all(evictions: Any, seals: Any,
                                                       first_seal_seq: Any) -> None:
    packed = records_in_c(evictions, seals, first_seal_seq)
    if packed is not None:
        assert same(packed, python_records(evictions, seals, first_seal_seq))


@needs_c
@pytest.mark.parametrize("evictions, seals, first_seal_seq", [
    ([True], {}, 1),  # a bool for a block id (struct packs it; C leaves it to Python)
    ([2**31], {}, 1),
    ([], {1: (1, b"k", 0, -1, 0, 256)}, 1),  # tier out of range
    ([], {1: (1, b"k" * 256, 0, -1, 0, 0)}, 1),  # a key longer than a record holds
    ([], {1: (1, bytearray(b"k"), 0, -1, 0, 0)}, 1),
    ([], {1: [1, b"k", 0, -1, 0, 0]}, 1),
    ([], {1: (1, b"k", -1, -1, 0, 0)}, 1),
    ([], {1: (1, b"k", 0, -1, 2**64, 0)}, 1),
    ([], {1: (1, b"k", 0, -1, 0, 0), 2: (2, b"k", 0, -1, 0, 0)}, 2**64 - 1),  # seal_seq overflows
    ((1,), {}, 1),
    ([], [(1, b"k", 0, -1, 0, 0)], 1),
])
def test_journal_rows_left_to_python(evictions: Any, seals: Any, first_seal_seq: Any) -> None:
    assert records_in_c(evictions, seals, first_seal_seq) is None


@needs_c
def test_journal_records_of_the_edges_of_every_field() -> None:
    rows = [(2**31 - 1, b"\xff" * 255, 2**64 - 1, -(2**31), 2**64 - 1, 255),
            (-(2**31), b"", 0, 2**31 - 1, 0, 0), (5, b"\x00" * 16, 1, -2, 1, 1)]
    seals = {row[0]: row for row in rows}
    for evictions in ([], [7, 2**31 - 1, -(2**31), 8], [0] * 3):
        assert same(records_in_c(evictions, seals, 2**64 - 3),
                    python_records(evictions, seals, 2**64 - 3))
    assert same(records_in_c([3, 4], {}, 1), python_records([3, 4], {}, 1))  # tombstones only
    assert records_in_c([], {}, 1) == (journal.DEFAULT_KEY_WIDTH, b"")


@needs_c
@in_use
def test_a_journal_writes_the_same_log_with_the_c_packer_and_without(tmp_path: Any) -> None:
    """Churn two journaled pools alike, one packing and applying its records in C and one in
    Python: the same chunks, compaction steps included, and the same view of the log."""
    from kvd.core.pool import BlockPool

    logs, states = [], []
    for use_c in (True, False):
        log = journal.Journal(tmp_path / f"c{use_c}", min_compact_records=16, compact_budget=32)
        pool = BlockPool(64, "lru", observer=log)
        journal.use_c(use_c)
        try:
            for start in range(0, 400, 20):  # a full pool from the fourth round on: evictions
                keys = [i.to_bytes(8 + start % 11, "little") for i in range(start, start + 20)]
                block_ids = pool.allocate(20, 1)
                log.commit()  # the evictions' tombstones alone
                pool.seal(block_ids, keys, 1, parents=[None] + keys[:-1])
                pool.release(block_ids[::2], 1)
                log.commit()
                log.tidy()  # compaction steps, which read chunk_of: applied in C or in settle()
                pool.release(block_ids[1::2], 1)
            log._log.settle()
            states.append((log._log.chunk_of, log._log.num_live, log._log.num_records))
        finally:
            journal.use_c(True)
        logs.append(log._db.execute("SELECT * FROM log ORDER BY chunk_id").fetchall())
        log.close()
    assert logs[0] == logs[1] and states[0] == states[1]
    assert states[0][1] == pool.num_cached and states[0][2] < 400 + 64  # compacted
    kinds = np.concatenate([np.frombuffer(records, journal._record_dtype(key_width))["kind"]
                            for _, key_width, records, *_ in logs[0]])
    assert set(kinds.tolist()) == {journal.SEAL, journal.EVICT}
    assert len({key_width for _, key_width, *_ in logs[0]}) >= 3  # runs of several key widths


def settled(commits: list[tuple[int, bytes]], num_slots: int) -> tuple[Any, int]:
    """chunk_of and num_live after `commits` -- (key width, records) each, as one chunk --
    by _LogState.settle, the specification."""
    state = journal._LogState()
    state.reserve(num_slots - 1)
    state.unsettled = [(chunk_id, key_width, records)
                       for chunk_id, (key_width, records) in enumerate(commits, 1)]
    state.settle()
    return state.chunk_of, state.num_live


@needs_c
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), max_size=8),
                          st.lists(st.tuples(st.integers(0, 40), st.binary(max_size=20)),
                                   max_size=8)), max_size=12),
       st.integers(min_value=1, max_value=5))
def test_records_apply_in_c_as_settle_applies_them(commits: list, max_chunk_records: int) -> None:
    """Commits applied one by one in C leave chunk_of and num_live as one settle() of them all,
    also where a commit's records span several chunks."""
    packed = [journal._records(evictions,
                               {block: (block, key, 1, -1, 0, 0) for block, key in rows}, 1)
              for evictions, rows in commits]
    chunk_of, num_live, chunk_id, spec = journal._LogState().chunk_of, 0, 1, []
    chunk_of.frombytes(bytes(8 * 41))
    for key_width, records in packed:
        step = max_chunk_records * (journal._HEADER_NBYTES + key_width)
        delta = journal_c.apply_records(chunk_of, records, key_width, chunk_id, max_chunk_records)
        assert delta is not None
        num_live += delta
        for start in range(0, len(records), step):
            spec.append((key_width, records[start:start + step]))
            chunk_id += 1
    assert (chunk_of, num_live) == settled(spec, 41)


@needs_c
def test_records_left_to_settle_leave_chunk_of_untouched() -> None:
    _, records = journal._records([3], {5: (5, b"k" * 16, 1, -1, 0, 0)}, 1)
    assert journal_c.apply_records(array("q", bytes(8 * 6)), records, 16, 1, 4096) == 1
    for chunk_of, blob, key_width in [
            (array("q", bytes(8 * 5)), records, 16),  # block 5 beyond chunk_of: settle reserves
            (array("i", bytes(8 * 6)), records, 16), (bytearray(48), records, 16),
            (bytes(48), records, 16), (array("q", bytes(48)), records[:-1], 16),
            (array("q", bytes(48)), records, 15),
            (array("q", bytes(48)), records[:32] + b"\x07" + records[33:], 16)]:  # no such kind
        before = bytes(chunk_of)
        assert journal_c.apply_records(chunk_of, blob, key_width, 1, 4096) is None
        assert bytes(chunk_of) == before


@needs_c
@in_use
def test_a_commit_applied_in_c_waits_for_older_chunks_left_to_settle(tmp_path: Any) -> None:
    """A commit whose records C could not apply (a block beyond chunk_of) waits for settle();
    the commits after it must wait too, or settle would apply the older records over theirs."""
    log = journal.Journal(tmp_path, compact_budget=1)  # every tidy() settles
    log.sealed([(100, b"a" * 16, 1, -1, 0, 0)])
    log.commit()
    log.tidy()  # chunk_of now has room for blocks up to 150
    log.sealed([(5, b"b" * 16, 1, -1, 0, 0), (200, b"c" * 16, 1, -1, 0, 0)])
    log.commit()  # block 200: left to settle()
    log.evicted(5)
    log.sealed([(7, b"d" * 16, 1, -1, 0, 0)])
    log.commit()
    log.tidy()
    view = log._log
    damage = journal.Damage()
    rescan = journal._scan(journal._checked(log._db.execute(
        f"{journal._SELECT_CHUNKS} ORDER BY chunk_id").fetchall(), damage), damage)[1]
    assert not damage.describe()
    assert view.num_live == rescan.num_live == 3
    assert list(view.chunk_of[:len(rescan.chunk_of)]) == list(rescan.chunk_of)
    assert not any(view.chunk_of[len(rescan.chunk_of):])
    log.close()
