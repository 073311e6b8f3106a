"""The write-ahead journal of the hash index: what lets a restarted daemon keep its KV blocks.

Theory of operation
-------------------
POSIX shared memory outlives the daemon, so after a crash every sealed block's bytes are still in
the segment; what dies is the in-memory map from content hash to block. The journal keeps that
map in SQLite (WAL mode, `synchronous=NORMAL`: a committed transaction survives the process
crashing — only an OS crash or power loss can lose the last commits, and those lose /dev/shm too).
By default it lives on /dev/shm beside the segment (kvd/runtime.py says why), so that its writes
and checkpoints never wait for a disk.

The map is kept as an append-only log of packed records (a log-structured design, as in
Rosenblum and Ousterhout's LFS), not as one table row per block:

    stamp(key, value)   journal/layout/hash versions, geometry, segment uuid, boot id, and a
                        checksum of them all
    log(chunk_id PK, key_width, records, seal_seq, checksum)
                        one row -- a *chunk* -- per group commit or compaction step; `records`
                        packs at most MAX_CHUNK_RECORDS records of 35 + key_width bytes;
                        seal_seq is the journal's seal counter once the chunk was written;
                        checksum a CRC-32 of the other four:

    record (little-endian, unaligned: one NumPy structured dtype decodes a whole log at once)
      offset  bytes  field
           0      8  seal_seq           u64: the order of seals (0 in a tombstone)
           8      8  generation         u64: the block's generation when it was sealed
          16      8  parent_generation  u64: the parent's generation then
          24      4  block_id           i32
          28      4  parent             i32: parent block id, NO_PARENT or ORPHAN
          32      1  kind               SEAL or EVICT
          33      1  tier               TIER_PREFILL or TIER_DECODE
          34      1  key_nbytes
          35      W  key                zero padded to W = key_width

A SEAL record is an indexed block's row, with its place in the prefix tree; an EVICT record (a
tombstone; only block_id is set) says the block no longer holds it. Replay rule: a block's last
record in log order (chunk id, then position) decides, and the live rows come back sorted by
seal_seq (oldest seal first, parents before their children). Why a log: a table row per block put
every sealed block on its own 4 KiB B-tree page (block ids are random once the pool churns), so a
commit of 16 evictions and 16 seals wrote 32 pages to the WAL: ~210 us of CPU, against ~45 us for
an append, which writes the last page or two (bench/recovery.py, one commit in-process; 3 ms
against 0.4 ms at batch 256). Recovery decodes a few large BLOBs with NumPy instead of fetching a
million 7-column rows: 1M blocks load in ~0.45 s from a log compacted to its longest, where the
table took ~3.7 s.

Generations make the rows self-checking: a block's generation changes whenever it is freed, so
recovery restores a row only if the segment still shows the generation the row recorded, and
links a child under its parent only if the parent is the same residency the child was sealed
under -- a parent block evicted and reused for other content is never mistaken for the old one.

Damage (a flipped bit in the database or its WAL) must never restore a row onto bytes it does not
describe. Three checks, each for what the others cannot see:
  * every chunk carries a CRC-32 of its id, key width, seal counter and records: a flip anywhere
    in a row (a block id, a key, a generation, a parent, a tier) fails it, and `load` drops the
    chunk (its blocks' older records, if any, then fail the generation check: a miss, never
    wrong bytes). Per chunk, not per record: one zlib call per commit on the commit path, and
    the C packing stays as it is. The stamp carries one too.
  * generations start at a random base per block (kvd/segment.py), so a record that names the
    wrong block -- damage the CRC missed -- cannot match that block's counter, and successive
    SEAL records of one block must carry rising generations: a live record not above an older
    one of its block is a duplicate claim, dropped.
  * the segment header keeps the seal counter of the last acknowledged commit (the journal
    hands it to `on_commit` after each commit, before any reply): a log whose chunks end at a
    lower counter lost acknowledged seals -- the WAL's own checksums silently drop every frame
    after a damaged one -- and `load` says how many. SQLite's quick_check covers the B-tree
    itself (a page that lost a cell loses whole chunks without failing any CRC).
Compaction never cleans the newest chunk, so the log's highest seal counter is always that of
its last write.

Compaction keeps the log, and so recovery, bounded. Superseded SEAL records and tombstones are
dead weight; the journal knows in memory which chunk holds each block's live SEAL record
(`_LogState.chunk_of`), brought up to date in one vectorised pass each time COMPACT_BUDGET
records were appended since the last. If the log then holds more than `compact_factor` x live
records + `min_compact_records`, that upkeep also *cleans* the oldest chunks, about
max(COMPACT_BUDGET, 2 x appended) records' worth, in its own transaction: live records are
copied verbatim to new chunks at the tail and the cleaned chunks deleted. This never changes what
replay yields: a moved record is its block's last record and stays so (it was live), its
seal_seq keeps the seal order, and a dropped tombstone has no older record of its block left
(those sit in the same or older chunks, cleaned first). Work per upkeep is bounded (no stall),
and amortised it is O(records appended): a chunk is cleaned only when the log holds more dead
records than live ones overall.

Commit and upkeep. `commit()` does only what a reply must wait for: it packs the buffered records
(`_records`) and inserts them as a chunk (usually one INSERT, atomic without BEGIN). Everything
else is upkeep, in `tidy()`, which the daemon runs once the iteration's replies are flushed, so
that no reply waits for it: bringing `chunk_of` up to date with the commits since it last did
(`settle`), a compaction step if one is due, and WAL checkpoints. Where kvd/server/_journal.c is
built, a commit packs its records in C and applies them to `chunk_of` at once, which costs less
than either step in Python (bench/recovery.py's in-process table, C and Python in turns: the commit
71 -> 50 us of CPU at batch 16, the upkeep 15 -> 11 us; the rest of a commit is mostly SQLite's
INSERT). `use_c` switches that C off and on in one process, for that bench and the twin tests.
SQLite's automatic checkpoint would run inside the commit that crosses its threshold, and a
checkpoint fsyncs the WAL and then the database file, 3-10 ms each on the bench machine's disk:
tidy() checkpoints once about CHECKPOINT_NBYTES were written (4 MiB, SQLite's own default size),
and SQLite's checkpoint only backs it up, at twice that. A larger threshold would not lower the
amortised cost, since an fsync's time grows with the bytes it flushes (commit + upkeep at batch 16:
40.5 us mean wall at 4 MiB, 39.5 us at 16 MiB), only lengthen the stall (10 ms max, against 34-37
ms at 16 MiB; bench/recovery.py's commit table).

Write rule (what makes recovery trustworthy):
  * a seal is acknowledged only after its record is committed -- otherwise a client could be
    told "sealed" for a block that recovery would not restore. The daemon holds every reply of
    a loop iteration until the iteration's one commit returns (a group commit); the upkeep
    after it writes nothing a reply depends on;
  * an eviction's tombstone needs no commit of its own: it rides along with the next seal's
    commit (or a clean `kvd stop --keep`). If the daemon dies first, the block's row survives
    but the eviction already bumped the block's generation in shared memory -- before its id
    reached a new owner -- so recovery drops the row (generation check) instead of restoring
    the new owner's bytes under the old hash. This halves the commits of a warm cache, where
    every allocation evicts.
Within one commit, tombstones precede seals; a block sealed and evicted since the last commit
leaves only its tombstone, and a block evicted and sealed again only its new SEAL record (which
supersedes the old one in the same atomic commit: a warm cache's allocation evicts the very
blocks its owner then seals, so this drops most tombstones).

Only indexed seals are journaled: unsealed (OWNED) blocks and private duplicates die with their
sessions anyway, and old sessions' pins are dropped on recovery -- every restored block is CACHED.
Keys are bytes of 1 to 255 bytes (the daemon allows 64; kvd.hash_blocks makes 16).

Failpoints: `KVD_FAILPOINT=<name>` makes the daemon SIGKILL itself at that point, so tests can
crash it exactly there: before-commit, after-commit-before-reply, mid-eviction, during-recovery,
mid-compaction (inside a compaction step's transaction, before it commits).
`KVD_JOURNAL_FAIL_FILE=<path>` (read when a Journal opens) makes every journal write fail while
that file exists.

A failed commit or upkeep puts the daemon in fail-closed mode: it refuses allocations and seals
with a JOURNAL error (lookups, reads and releases go on), and about once a second tries to rewrite
the whole index; the first rewrite that succeeds ends the mode. A failed write also makes the
journal forget its in-memory view of the log; the next write rebuilds it from the database.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import struct
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import count, islice, repeat
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np

from kvd import native
from kvd.errors import JournalError
from kvd.core.pool import IndexRows, JournalRow
from kvd.runtime import private_dir

FAILPOINTS = ("before-commit", "after-commit-before-reply", "mid-eviction", "during-recovery",
              "mid-compaction")
JOURNAL_FILENAME = "journal.sqlite3"


def pool_journal_filename(pool: str) -> str:
    """The journal of one of several pools (a single-pool daemon's is JOURNAL_FILENAME)."""
    return f"journal-{pool}.sqlite3"


_LOG_TABLE = """CREATE TABLE IF NOT EXISTS log (
    chunk_id INTEGER PRIMARY KEY,
    key_width INTEGER NOT NULL,
    records BLOB NOT NULL,
    seal_seq INTEGER NOT NULL,
    checksum INTEGER NOT NULL
)"""
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS stamp (key TEXT PRIMARY KEY, value TEXT NOT NULL);
{_LOG_TABLE};
"""
# Bumped whenever the schema changes: a journal of another version never matches the stamp.
JOURNAL_VERSION = 4

_INSERT_CHUNK = "INSERT INTO log VALUES (?, ?, ?, ?, ?)"
_SELECT_CHUNKS = "SELECT chunk_id, key_width, records, seal_seq, checksum FROM log"
_CHUNK_META = struct.Struct("<qqQ")  # what a chunk's checksum covers besides its records

SEAL, EVICT = 1, 2
_HEADER_FIELDS = [("seal_seq", "<u8"), ("generation", "<u8"), ("parent_generation", "<u8"),
                  ("block_id", "<i4"), ("parent", "<i4"), ("kind", "u1"), ("tier", "u1"),
                  ("key_nbytes", "u1")]
_HEADER_NBYTES = 35  # of a record, before its key
MAX_KEY_NBYTES = 255  # key_nbytes is one byte
DEFAULT_KEY_WIDTH = 16  # kvd.hash_blocks: chunks of tombstones only use it too, so runs stay long
# A chunk is what one compaction step reads or writes at a time: 4096 records of 16-byte keys
# are 200 KiB, a fraction of a millisecond to decode and rewrite.
MAX_CHUNK_RECORDS = 4096
COMPACT_BUDGET = 1024  # records a compaction step cleans at least (whole chunks, oldest first)
PAGE_NBYTES = 4096  # SQLite's default page size
CHECKPOINT_NBYTES = 4 << 20  # WAL bytes that make tidy() checkpoint (module docstring)
_CHUNK = tuple[int, int]  # (chunk id, number of records)
_BytesRow = tuple[int, bytes, int, int, int, int]  # a JournalRow as the daemon makes it


@cache
def _record_dtype(key_width: int) -> np.dtype:
    return np.dtype(_HEADER_FIELDS + [("key", "u1", (key_width,))])


@cache
def _record_struct(key_width: int) -> struct.Struct:
    return struct.Struct(f"<QQQiiBBB{key_width}s")


@cache
def _tombstone_struct(key_width: int) -> struct.Struct:
    """A record with only block_id and kind set: two arguments to pack instead of nine."""
    return struct.Struct(f"<24xi4xB{2 + key_width}x")


def _records(evictions: list[int], seals: dict[int, JournalRow],
             first_seal_seq: int) -> tuple[int, bytes]:
    """The records of one commit, packed: a tombstone per block of `evictions` that was not
    sealed again since (its SEAL record supersedes the old one by itself), then a SEAL record
    per row of `seals` in order, numbered from `first_seal_seq`; and their key width (the
    longest key; DEFAULT_KEY_WIDTH without seals). kvd/server/_journal.c's journal_records is the
    same function for the usual rows, 10x faster at batch 16 (1.3 against 13.7 us, timeit)."""
    rows = cast("dict[int, _BytesRow]", seals)  # (a key of another type: struct raises)
    key_width = max([len(row[1]) for row in rows.values()], default=DEFAULT_KEY_WIDTH)
    if key_width > MAX_KEY_NBYTES:
        raise sqlite3.DataError(f"a key of {key_width} bytes: the journal keeps at most "
                                f"{MAX_KEY_NBYTES}")
    pack = _record_struct(key_width).pack
    # A loop over the rows: transposing them to map() the packing over columns costs more than
    # the loop.
    records = [pack(seal_seq, generation, parent_generation, block_id, parent, SEAL, tier,
                    len(key), key)
               for seal_seq, (block_id, key, generation, parent, parent_generation, tier)
               in enumerate(rows.values(), first_seal_seq)]
    if evictions:
        records[:0] = map(_tombstone_struct(key_width).pack,
                          [block_id for block_id in evictions if block_id not in seals],
                          repeat(EVICT))
    return key_width, b"".join(records)


def _checksum(chunk_id: int, key_width: int, seal_seq: int, records: bytes) -> int:
    """A chunk's CRC-32: of its records, then of its id, key width and seal counter."""
    return zlib.crc32(_CHUNK_META.pack(chunk_id, key_width, seal_seq), zlib.crc32(records))


def _stamp_checksum(stamp: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(stamp, sort_keys=True).encode())


STAMP_CHECKSUM = "checksum"  # the stamp's own key for its checksum


@dataclass
class Damage:
    """What `Journal.load` found wrong with the log and left out (all zero: nothing)."""

    num_chunks: int = 0  # chunks read
    bad_chunks: int = 0  # failed their checksum, or held no whole records
    bad_records: int = 0  # records in those, as far as their sizes tell
    duplicate_claims: int = 0  # live records a block or key had already been claimed by
    shared_slabs: int = 0  # records in an arena slab another pool's journal claims too
    unreadable: str = ""  # SQLite's error where reading the log stopped short
    check: str = ""  # the first complaint of SQLite's quick_check

    def describe(self) -> list[str]:
        """One phrase per kind of damage found (none: the log is sound)."""
        found = []
        if self.check:
            found.append(f"SQLite's check found {self.check!r}")
        if self.unreadable:
            found.append(f"reading it stopped after {self.num_chunks} chunks ({self.unreadable})")
        if self.bad_chunks:
            found.append(f"{self.bad_chunks} of {self.num_chunks} chunks failed their checksum "
                         f"({self.bad_records} records dropped)")
        if self.duplicate_claims:
            found.append(f"{self.duplicate_claims} duplicate claims on a block or hash "
                         "dropped")
        if self.shared_slabs:
            found.append(f"{self.shared_slabs} records in slabs another pool's journal claims "
                         "too dropped")
        return found


class Loaded(NamedTuple):
    """What `Journal.load` read: the rows that check out, the seal counter the log ends at, and
    what it left out."""

    rows: IndexRows
    seal_seq: int
    damage: Damage


_c = native.load("journal")  # kvd/server/_journal.c, or None where the Python runs


def use_c(enabled: bool) -> bool:
    """Turn kvd/server/_journal.c on or off in this process (bench/recovery.py and the twin tests
    compare the two in one run); returns whether it is on, which it never is where it was not
    built or with KVD_PURE_PYTHON=1."""
    global _c
    _c = native.load("journal") if enabled else None
    return _c is not None


def _inject_failure(fail_file: str | None) -> None:
    """Tests make journal writes fail while the file KVD_JOURNAL_FAIL_FILE names exists."""
    if fail_file and os.path.exists(fail_file):
        raise sqlite3.OperationalError("disk I/O error (injected by KVD_JOURNAL_FAIL_FILE)")


# Read once: failpoints sit on hot paths (every eviction), and os.environ costs ~0.5 us a look.
_FAILPOINT = os.environ.get("KVD_FAILPOINT")


def failpoint(name: str) -> None:
    """Crash this process (SIGKILL: no cleanup at all) if KVD_FAILPOINT named `name` when kvd
    was imported."""
    if _FAILPOINT == name:
        os.kill(os.getpid(), signal.SIGKILL)


class _LogState:
    """What the journal knows of its log, kept in memory so that writes never read it back."""

    def __init__(self) -> None:
        self.chunk_of = array("q")  # per block id: the chunk holding its live SEAL record, or 0
        self.chunks: deque[_CHUNK] = deque()  # every chunk, oldest first
        self.num_records = 0
        self.num_live = 0  # blocks with a live SEAL record, as of the chunks applied so far
        self.seal_seq = 0  # the last seal_seq handed out
        self.next_chunk_id = 1
        # Chunks appended by commits and not yet reflected in chunk_of and num_live, as
        # (chunk id, key width, records), applied by settle() in batches, so that no reply waits
        # for them (kvd/server/_journal.c applies a commit's chunks at once instead: then this is
        # empty).
        self.unsettled: list[tuple[int, int, bytes]] = []
        self.num_appended = 0  # records appended by commits since the last settle()

    def settle(self) -> None:
        """Bring `chunk_of` and `num_live` up to date with every commit so far, in one
        vectorised pass that decodes the chunks appended since the last call (a Python loop
        over their rows cost ~3 us per batch-16 commit, bench/recovery.py's commit table)."""
        runs = _runs(self.unsettled)
        self.unsettled.clear()
        self.num_appended = 0
        if not runs:
            return
        placed = _joined([records["block_id"] for records, _ in runs]).astype(np.int64)
        # A tombstone leaves its block no live record: chunk 0.
        placed_in = _joined([np.where(records["kind"] == SEAL, chunk_ids, 0)
                             for records, chunk_ids in runs])
        self.reserve(int(placed.max()))
        # Each block's last record in log order decides: the first in the reversed order.
        blocks, reversed_at = np.unique(placed[::-1], return_index=True)
        chunks = placed_in[placed.size - 1 - reversed_at]
        chunk_of = np.frombuffer(self.chunk_of, dtype=np.int64)
        self.num_live += int(np.count_nonzero(chunks)) - int(np.count_nonzero(chunk_of[blocks]))
        chunk_of[blocks] = chunks

    def reserve(self, max_block_id: int) -> None:
        """Make room in `chunk_of` for blocks up to `max_block_id`."""
        chunk_of = self.chunk_of
        if max_block_id >= len(chunk_of):  # grown by half again: amortised O(1) per block
            chunk_of.frombytes(bytes(8 * (max_block_id + 1 - len(chunk_of) + len(chunk_of) // 2)))

    def is_compaction_due(self, factor: float, min_records: int) -> bool:
        return self.num_records > factor * self.num_live + min_records


class Journal:
    """The hash-index journal in `state_dir`. Writes are buffered until `commit()`."""

    def __init__(self, state_dir: str | os.PathLike[str], compact_factor: float = 2.0,
                 min_compact_records: int = 65_536, compact_budget: int = COMPACT_BUDGET,
                 filename: str = JOURNAL_FILENAME) -> None:
        """Args:
            state_dir: directory of the journal files (made 0700 if missing).
            filename: the database's name there (one per pool: `pool_journal_filename`).
            compact_factor, min_compact_records: compaction is due while the log holds more than
                compact_factor x live records + min_compact_records (module docstring).
            compact_budget: records a compaction step cleans at least.
        """
        self.state_dir = private_dir(Path(state_dir), "pass another --state-dir")
        self.path = self.state_dir / filename
        self.compact_factor = compact_factor
        self.min_compact_records = min_compact_records
        self.compact_budget = compact_budget
        # Read once (os.environ costs ~1 us a look, on every commit).
        self._fail_file = os.environ.get("KVD_JOURNAL_FAIL_FILE")
        self._open()
        self._num_wal_nbytes = 0  # about what the WAL holds since the last checkpoint
        # Pending seals by block id: an eviction of a block sealed since the last commit drops
        # its seal here (tombstones are written first, so a buffered seal would outlive it).
        self._seals: dict[int, JournalRow] = {}
        self._evictions: list[int] = []
        self._num_seals_pending = 0
        self._log: _LogState | None = None  # None: unknown, rebuilt from the database when needed
        # Told the seal counter after each commit or rewrite, before any reply (the daemon
        # writes it into the segment's header: kvd/segment.py).
        self.on_commit: Callable[[int], None] | None = None
        self._committed_seal_seq = 0  # the counter on_commit was last told: rewrite goes on from it

    def _open(self) -> None:
        try:
            _make_private(self.path)
            self._db = sqlite3.connect(self.path, isolation_level=None)
            # One writer (the daemon holds the name's flock anyway): no shared-memory WAL index
            # and no file locking per transaction saves ~5 us of CPU per commit (of ~25 at batch
            # 1). Nobody else can read the journal while it is open; a crash leaves the WAL,
            # which the next opener replays.
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            # SQLite's own checkpoint runs inside the commit that crosses its threshold, on a
            # reply's path: tidy() checkpoints first; this one is only a backstop.
            self._db.execute(f"PRAGMA wal_autocheckpoint={2 * CHECKPOINT_NBYTES // PAGE_NBYTES}")
            self._db.executescript(_SCHEMA)
        # (ValueError: a damaged schema's message is not always UTF-8)
        except (sqlite3.Error, OSError, ValueError) as exc:
            raise JournalError(f"cannot open the journal {self.path}: {exc}") from None
        self._cursor = self._db.cursor()  # reused: conn.execute() makes a cursor per call

    # ---- the pool observer interface (called from BlockPool) ------------------------------
    def sealed(self, rows: list[JournalRow]) -> None:
        seals = self._seals
        for row in rows:
            seals[row[0]] = row
        self._num_seals_pending += len(rows)

    def evicted(self, block_id: int) -> None:
        if _FAILPOINT is not None:  # a call per eviction otherwise: 16 of them per warm alloc
            failpoint("mid-eviction")
        self._seals.pop(block_id, None)
        self._evictions.append(block_id)

    # ---- committing ------------------------------------------------------------------------
    @property
    def is_dirty(self) -> bool:
        return self.num_pending > 0

    @property
    def num_seals_pending(self) -> int:
        """Seals buffered since the last commit: replies that must wait for it."""
        return self._num_seals_pending

    @property
    def num_pending(self) -> int:
        """Changes buffered since the last commit (grows whenever a handler touched the index)."""
        return self._num_seals_pending + len(self._evictions)

    @property
    def num_log_records(self) -> int:
        """Records in the log, live and dead (reads the log if this journal has not yet)."""
        return self._log_state().num_records

    def commit(self) -> None:
        """Write every buffered change in one transaction: the durable step that replies wait
        for (the rest waits for `tidy()`). Raises JournalError on failure."""
        if not self._num_seals_pending and not self._evictions:
            return
        seals, evictions = self._seals, self._evictions
        self._clear_pending()
        failpoint("before-commit")
        # Usually one chunk: a single INSERT is atomic by itself, and BEGIN/COMMIT round trips
        # cost ~5 us in the daemon (whose loop leaves SQLite's code cache-cold). (An upper bound
        # of the records: evictions of blocks sealed again leave no tombstone.)
        self._transaction(lambda: self._append(self._log_state(), evictions, seals),
                          is_atomic=len(evictions) + len(seals) <= MAX_CHUNK_RECORDS)
        self._committed()
        failpoint("after-commit-before-reply")

    def tidy(self) -> None:
        """Upkeep that no reply waits for (the daemon runs it once the commit's replies are
        out): bring the view of the log up to date, clean its oldest chunks if compaction is
        due (in a transaction of its own) and checkpoint the WAL if due. Raises JournalError on
        failure."""
        log = self._log
        if log is not None and log.num_appended >= self.compact_budget:
            num_appended = log.num_appended
            log.settle()
            if log.is_compaction_due(self.compact_factor, self.min_compact_records):
                budget = max(self.compact_budget, 2 * num_appended)
                self._transaction(lambda: self._compact(log, budget))
        if self._num_wal_nbytes >= CHECKPOINT_NBYTES:
            self._transaction(self._checkpoint, is_atomic=True)

    def rewrite(self, rows: Sequence[JournalRow]) -> None:
        """Replace every row with `rows` — (block_id, key, generation, parent, parent_generation,
        tier), oldest first — after a failed commit lost some changes."""
        self._clear_pending()
        fresh = _LogState()
        # Numbered on from the last counter the segment was told, never below it.
        fresh.seal_seq = self._committed_seal_seq

        def replace_all() -> None:
            self._db.execute("DELETE FROM log")
            self._append(fresh, [], {row[0]: row for row in rows})

        self._transaction(replace_all)
        self._log = fresh
        self._committed()

    def _clear_pending(self) -> None:
        self._seals, self._evictions, self._num_seals_pending = {}, [], 0

    def _committed(self) -> None:
        """Tell on_commit the seal counter the log now ends at (module docstring)."""
        assert self._log is not None  # (a commit succeeded: the log is known)
        self._committed_seal_seq = self._log.seal_seq
        if self.on_commit is not None:
            self.on_commit(self._committed_seal_seq)

    def _transaction(self, body: Any, is_atomic: bool = False) -> None:
        """Run `body` in a transaction; JournalError if it fails.

        is_atomic: `body` makes one write, which SQLite commits atomically without BEGIN.
        """
        try:
            _inject_failure(self._fail_file)
            if is_atomic:
                body()
                return
            self._cursor.execute("BEGIN")
            body()
            self._cursor.execute("COMMIT")
        except (sqlite3.Error, ValueError) as exc:  # (ValueError: a message quoting damaged bytes)
            self._rollback()
            self._log = None  # it may have seen changes that were rolled back
            raise JournalError(f"journal write to {self.path} failed: {exc}") from None

    def _rollback(self) -> None:
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # no transaction was open: nothing to undo

    def _checkpoint(self) -> None:
        """Copy the WAL into the database; the next write starts the WAL over."""
        self._cursor.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        self._num_wal_nbytes = 0

    # ---- the log ---------------------------------------------------------------------------
    def _append(self, log: _LogState, evictions: list[int],
                seals: dict[int, JournalRow]) -> None:
        """Append tombstones, then seals, as new chunks, and bring `chunk_of` up to date with
        them: at once in C, else in the next settle()."""
        c = _c  # (one look-up for both steps below)
        packed = c.journal_records(evictions, seals, log.seal_seq + 1, DEFAULT_KEY_WIDTH) \
            if c is not None else None  # the usual rows packed in C, or None
        key_width, records = packed or _records(evictions, seals, log.seal_seq + 1)
        step = MAX_CHUNK_RECORDS * (_HEADER_NBYTES + key_width)
        first_chunk_id = log.next_chunk_id
        log.seal_seq += len(seals)  # (before the chunks, which carry it)
        written = self._write_chunks(  # (a slice of all of a bytes object is no copy)
            log, key_width, [records[start:start + step] for start in range(0, len(records), step)])
        log.num_appended += len(records) // (_HEADER_NBYTES + key_width)
        # In C the chunks apply at once (~0.5 us per record less than settle's NumPy pass at
        # batch 16) -- unless older ones still wait for settle(), which must apply first.
        num_live = c.apply_records(log.chunk_of, records, key_width, first_chunk_id,
                                   MAX_CHUNK_RECORDS) \
            if c is not None and not log.unsettled else None
        if num_live is None:  # (also for a block beyond chunk_of: settle() reserves room)
            log.unsettled += written
        else:
            log.num_live += num_live

    def _write_chunks(self, log: _LogState, key_width: int,
                      blobs: list[bytes]) -> list[tuple[int, int, bytes]]:
        """Insert `blobs` as the next chunks, each of whole records of `key_width`, with the
        log's seal counter and their checksums; returns them as (chunk id, key width, records)."""
        record_nbytes = _HEADER_NBYTES + key_width
        written = []
        for blob in blobs:  # one execute per chunk: cheaper than executemany for the usual one
            chunk_id, seal_seq = log.next_chunk_id, log.seal_seq
            self._cursor.execute(_INSERT_CHUNK, (chunk_id, key_width, blob, seal_seq,
                                                 _checksum(chunk_id, key_width, seal_seq, blob)))
            written.append((chunk_id, key_width, blob))
            log.chunks.append((log.next_chunk_id, len(blob) // record_nbytes))
            log.num_records += len(blob) // record_nbytes
            log.next_chunk_id += 1
            self._num_wal_nbytes += len(blob) + PAGE_NBYTES  # and the B-tree's last leaf page
        return written

    def _compact(self, log: _LogState, budget: int) -> None:
        """Clean the oldest chunks worth about `budget` records, all but the newest (whose seal
        counter is the log's: module docstring): keep their live records only."""
        num_chunks, num_scanned = 0, 0
        for _, num_records in islice(log.chunks, len(log.chunks) - 1):
            if num_scanned >= budget:
                break
            num_chunks += 1
            num_scanned += num_records
        if not num_chunks:
            return
        first, last = log.chunks[0][0], log.chunks[num_chunks - 1][0]
        rows = self._db.execute("SELECT chunk_id, key_width, records FROM log "
                                "WHERE chunk_id BETWEEN ? AND ? ORDER BY chunk_id",
                                (first, last)).fetchall()
        self._db.execute("DELETE FROM log WHERE chunk_id BETWEEN ? AND ?", (first, last))
        for _ in range(num_chunks):
            log.chunks.popleft()
        log.num_records -= num_scanned
        for key_width, live in _live_records(log, rows).items():
            self._move(log, key_width, live)
        failpoint("mid-compaction")

    def _move(self, log: _LogState, key_width: int, live: np.ndarray) -> None:
        """Append live records, verbatim, as new chunks and point `chunk_of` at them."""
        starts = range(0, live.size, MAX_CHUNK_RECORDS)
        chunk_ids = log.next_chunk_id + np.arange(live.size) // MAX_CHUNK_RECORDS
        np.frombuffer(log.chunk_of, dtype=np.int64)[live["block_id"]] = chunk_ids
        self._write_chunks(log, key_width, [live[start:start + MAX_CHUNK_RECORDS].tobytes()
                                            for start in starts])

    def _log_state(self) -> _LogState:
        if self._log is None:
            damage = Damage()
            self._log = _scan(_checked(self._read_chunks(damage), damage), damage)[1]
        return self._log

    # ---- stamp and recovery ----------------------------------------------------------------
    def read_stamp(self) -> dict[str, Any]:
        """Raises:
            JournalError: the stamp cannot be read (a damaged row or table)."""
        try:
            rows = self._db.execute("SELECT key, value FROM stamp").fetchall()
            found = {key: json.loads(value) for key, value in rows}
            checksum = found.pop(STAMP_CHECKSUM, None)
            # (a journal of an older version has none: it fails the version check instead)
            if found and (checksum is not None or found.get("journal_version") == JOURNAL_VERSION) \
                    and checksum != _stamp_checksum(found):
                raise ValueError("its checksum does not match")
            return found
        except (sqlite3.Error, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise JournalError(f"the stamp of the journal {self.path} cannot be read "
                               f"({exc})") from None

    def reset(self, stamp: dict[str, Any]) -> None:
        """Forget every block and record a new stamp (a clean start). The log table is made
        anew, in this version's schema, whatever version made the old one.

        Raises:
            JournalError: the database could not be written (damaged, say)."""
        self._clear_pending()

        def replace_all() -> None:
            self._db.execute("DROP TABLE IF EXISTS log")
            self._db.execute(_LOG_TABLE)
            self._db.execute("DELETE FROM stamp")
            self._db.executemany("INSERT INTO stamp VALUES (?, ?)",
                                 [(key, json.dumps(value)) for key, value in stamp.items()]
                                 + [(STAMP_CHECKSUM, json.dumps(_stamp_checksum(stamp)))])

        self._transaction(replace_all)
        self._log = _LogState()
        self._committed_seal_seq = 0

    def load(self) -> Loaded:
        """Every journaled block that checks out, oldest seal first (columns as NumPy arrays,
        keys as bytes), the seal counter the log ends at, and what was left out: chunks that
        fail their checksum, duplicate claims, and whatever SQLite could not read."""
        damage = Damage()
        try:
            (verdict,) = self._db.execute("PRAGMA quick_check(1)").fetchone()
            if verdict != "ok":
                damage.check = str(verdict)
        except (sqlite3.Error, ValueError) as exc:  # (a message quoting damaged bytes)
            damage.check = str(exc)
        rows, self._log = _scan(_checked(self._read_chunks(damage), damage), damage)
        self._committed_seal_seq = self._log.seal_seq
        return Loaded(rows, self._log.seal_seq, damage)

    def _read_chunks(self, damage: Damage) -> list[tuple[Any, ...]]:
        """Every chunk SQLite can read, in order: where it fails, the chunks before the failure
        (the error goes in `damage`)."""
        rows: list[tuple[Any, ...]] = []
        # A damaged row may hold TEXT that is not UTF-8: as bytes it only fails its checksum.
        self._db.text_factory = bytes
        try:
            cursor = self._db.execute(f"{_SELECT_CHUNKS} ORDER BY chunk_id")
            while batch := cursor.fetchmany(1024):
                rows += batch
        except (sqlite3.Error, ValueError) as exc:  # (a message quoting damaged bytes)
            damage.unreadable = str(exc)
        finally:
            self._db.text_factory = str
        return rows

    def set_aside(self) -> Path:
        """Keep the journal's files as they are (set_aside_files) and open an empty journal in
        their place; returns where they went. Copied before the connection closes: closing
        checkpoints the WAL into the database file, which would lose what it could not read."""
        aside = set_aside_files(self.state_dir, close=self.close, filename=self.path.name)
        self._open()
        self._log = None
        return aside

    def close(self) -> None:
        self._db.close()

    def remove(self) -> None:
        """Close and delete the journal files (a plain `kvd stop`)."""
        self.close()
        remove_journal(self.state_dir, filename=self.path.name)


class PoolJournals:
    """The journals of several pools, one file each (`pool_journal_filename`), which the loop
    commits, tidies and releases as one: a reply that awaits a seal goes out once every
    journal's commit is in, and a pool restarts clean without touching the others' files."""

    def __init__(self, state_dir: str | os.PathLike[str], journals: dict[str, Journal]) -> None:
        self.path = Path(state_dir)  # (named in the loop's log lines)
        self.journals = journals
        # Each pool's rows, for `rewrite` after a failed commit (startup fills it in).
        self.rows_of: dict[str, Callable[[], Sequence[JournalRow]]] = {}

    @property
    def num_seals_pending(self) -> int:
        return sum(journal.num_seals_pending for journal in self.journals.values())

    def commit(self) -> None:
        for journal in self.journals.values():
            if journal.num_seals_pending:  # tombstones alone wait, as in the loop
                journal.commit()

    def tidy(self) -> None:
        for journal in self.journals.values():
            journal.tidy()

    def rewrite_pools(self) -> None:
        """Every pool's journal rewritten from its pool (Journal.rewrite)."""
        for name, journal in self.journals.items():
            journal.rewrite(self.rows_of[name]())

    def close(self) -> None:
        for journal in self.journals.values():
            journal.close()

    def remove(self) -> None:
        for journal in self.journals.values():
            journal.remove()


def _make_private(path: Path) -> None:
    """Create the database file 0600 before SQLite opens it, and make 0600 any journal file left
    by an older kvd: SQLite creates the -wal and -shm files with the database file's mode."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    for suffix in ("", "-wal", "-shm"):
        try:
            os.chmod(f"{path}{suffix}", 0o600)
        except FileNotFoundError:
            pass


def set_aside_files(state_dir: str | os.PathLike[str], close: Callable[[], None] | None = None,
                    filename: str = JOURNAL_FILENAME) -> Path:
    """Copy the journal files `filename` in `state_dir` to `<filename>.damaged-N` (its -wal
    beside it, so that SQLite opens the two together), call `close` (the open connection's), and
    delete them; returns the copy's name. Raises JournalError if they cannot be copied."""
    path = Path(state_dir) / filename
    for number in count(1):
        aside = path.with_name(f"{filename}.damaged-{number}")
        if not any(os.path.lexists(f"{aside}{suffix}") for suffix in ("", "-wal")):
            break
    try:
        for suffix in ("", "-wal"):
            if os.path.exists(f"{path}{suffix}"):
                shutil.copyfile(f"{path}{suffix}", f"{aside}{suffix}")
                os.chmod(f"{aside}{suffix}", 0o600)
    except OSError as exc:
        raise JournalError(f"cannot copy the damaged journal {path} aside ({exc}), so it is kept "
                           f"as it was: make room in {path.parent}, or move it away") from None
    if close is not None:
        close()
    remove_journal(state_dir, keep_dir=True, filename=filename)
    return aside


def remove_journal(state_dir: str | os.PathLike[str], keep_dir: bool = False,
                   filename: str = JOURNAL_FILENAME) -> None:
    """Delete the journal files `filename` in `state_dir`, and the directory if that empties it
    (unless `keep_dir`). Damaged journals set aside there are kept (and so is the directory)."""
    path = Path(state_dir) / filename
    for suffix in ("", "-wal", "-shm"):
        try:
            os.unlink(f"{path}{suffix}")
        except FileNotFoundError:
            pass
    if keep_dir:
        return
    try:
        Path(state_dir).rmdir()
    except OSError:
        pass  # absent, or not empty: it holds files that are not ours


# ---- decoding ---------------------------------------------------------------------------------
def _live_records(log: _LogState, rows: list[tuple[int, int, bytes]]) -> dict[int, np.ndarray]:
    """The records of chunks `rows` that are still live, by key width."""
    chunk_of = np.frombuffer(log.chunk_of, dtype=np.int64)
    live: dict[int, list[np.ndarray]] = {}
    for records, chunk_ids in _runs(rows):  # many small chunks decode as one array
        is_live = records["kind"] == SEAL
        # Only SEAL records are looked up: a tombstone may name a block never placed here.
        is_live[is_live] = chunk_of[records["block_id"][is_live]] == chunk_ids[is_live]
        live.setdefault(records.dtype["key"].shape[0], []).append(records[is_live])
    return {key_width: np.concatenate(parts) for key_width, parts in live.items()}


def _runs(rows: Sequence[tuple[Any, ...]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Decode chunks, oldest first: (records, chunk id of each) per run of one key width."""
    runs, start = [], 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end][1] != rows[start][1]:
            dtype = _record_dtype(rows[start][1])
            records = np.frombuffer(b"".join(row[2] for row in rows[start:end]), dtype=dtype)
            counts = [len(row[2]) // dtype.itemsize for row in rows[start:end]]
            runs.append((records, np.repeat([row[0] for row in rows[start:end]], counts)))
            start = end
    return runs


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The parts laid end to end; the part itself when there is one (no copy)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _column(runs: list[tuple[np.ndarray, np.ndarray]], name: str) -> np.ndarray:
    """Field `name` of every record in log order: with one key width (the usual log) a view of
    the decoded records, so that only the rows picked from it are copied."""
    return _joined([records[name] for records, _ in runs]) if runs else np.zeros(0, np.int64)


def _checked(rows: list[tuple[Any, ...]], damage: Damage) -> list[tuple[int, int, bytes, int]]:
    """The chunks of `rows` (as SELECTed) whose checksum holds, as (chunk id, key width,
    records, seal counter); the others are counted in `damage`. (A damaged row may hold values
    of any type: whatever fails to check, fails.)"""
    checked = []
    for row in rows:
        try:
            chunk_id, key_width, records, seal_seq, checksum = row
            is_whole = 0 <= key_width <= MAX_KEY_NBYTES and type(records) is bytes \
                and len(records) % (_HEADER_NBYTES + key_width) == 0
            is_good = is_whole and checksum == _checksum(chunk_id, key_width, seal_seq, records)
        except (TypeError, ValueError, OverflowError, struct.error):
            is_good = False
        if is_good:
            checked.append((chunk_id, key_width, records, seal_seq))
            continue
        damage.bad_chunks += 1
        try:
            damage.bad_records += len(row[2]) // (_HEADER_NBYTES + row[1])
        except (TypeError, ZeroDivisionError):
            pass  # no size to tell
    damage.num_chunks += len(rows)
    return checked


def _scan(rows: list[tuple[int, int, bytes, int]],
          damage: Damage) -> tuple[IndexRows, _LogState]:
    """Replay a whole log of checked chunks: the live rows, oldest seal first, and the state to
    append after it; duplicate claims are left out, counted in `damage`.

    Only the columns that pick the live rows are read whole (block id, kind, seal order); the
    rest are read at the live rows only (copying and widening every column of a 2M-record log
    first cost ~0.2 s of a 1M-block recovery, bench/recovery.py)."""
    runs = _runs(rows)
    block_ids = _column(runs, "block_id")
    last = np.full(int(block_ids.max(initial=-1)) + 1, -1, dtype=np.int64)
    np.maximum.at(last, block_ids, np.arange(block_ids.size))  # each block's last record
    kinds = _column(runs, "kind")
    live = last[last >= 0]
    live = live[kinds[live] == SEAL]
    live = _unclaimed(runs, block_ids, kinds, last, live, damage)
    seal_seqs = _column(runs, "seal_seq")
    live = live[np.argsort(seal_seqs[live], kind="stable")]

    def picked(name: str, dtype: type) -> np.ndarray:
        return _column(runs, name)[live].astype(dtype, copy=False)

    live_ids = picked("block_id", np.int64)
    state = _LogState()
    chunk_of = np.zeros(last.size, dtype=np.int64)
    if runs:
        chunk_of[live_ids] = _joined([chunk_ids for _, chunk_ids in runs])[live]
    state.chunk_of = array("q", chunk_of.tobytes())
    state.chunks = deque((row[0], len(row[2]) // _record_dtype(row[1]).itemsize) for row in rows)
    state.num_records, state.num_live = block_ids.size, live.size
    state.seal_seq = max((row[3] for row in rows), default=0)
    state.next_chunk_id = rows[-1][0] + 1 if rows else 1
    # NumPy columns, which IndexRows takes (its docstring) though NumPy does not type them as
    # the Sequence[int] its fields name.
    columns: list[Any] = [live_ids, _keys(runs, live), picked("generation", np.uint64),
                          picked("parent", np.int64), picked("parent_generation", np.uint64),
                          picked("tier", np.uint8)]
    return IndexRows(*columns), state


def _unclaimed(runs: list[tuple[np.ndarray, np.ndarray]], block_ids: np.ndarray,
               kinds: np.ndarray, last: np.ndarray, live: np.ndarray,
               damage: Damage) -> np.ndarray:
    """`live` (positions of each block's last record, a SEAL) less those whose block an older
    SEAL record claimed at the same or a higher generation: a block's generation rises every
    time it is freed, so in a sound log its SEAL records rise too (module docstring)."""
    seals = np.flatnonzero(kinds == SEAL)
    older = seals[last[block_ids[seals]] != seals]
    if not older.size:
        return live
    generations = _column(runs, "generation")
    highest = np.zeros(last.size, dtype=np.uint64)
    np.maximum.at(highest, block_ids[older], generations[older])
    has_older = np.zeros(last.size, dtype=bool)
    has_older[block_ids[older]] = True
    live_blocks = block_ids[live]
    is_claimed = has_older[live_blocks] & (generations[live] <= highest[live_blocks])
    damage.duplicate_claims += int(np.count_nonzero(is_claimed))
    return live[~is_claimed]


def _keys(runs: list[tuple[np.ndarray, np.ndarray]], positions: np.ndarray) -> list[Hashable]:
    """The keys of the records at `positions` (into the runs laid end to end), as bytes."""
    keys: list[Hashable] = [b""] * positions.size
    offset = 0
    for records, _ in runs:
        in_run = (positions >= offset) & (positions < offset + records.size)
        slots, local = np.flatnonzero(in_run), positions[in_run] - offset
        key_nbytes = records["key_nbytes"][local]
        for nbytes in np.unique(key_nbytes).tolist():
            picked = key_nbytes == nbytes
            # A void view keeps every byte (a bytes dtype would strip trailing zeros).
            found = np.ascontiguousarray(records["key"][local[picked], :nbytes]) \
                .view(f"V{nbytes}").ravel().tolist()
            if found and len(found) == positions.size:
                return found  # the usual case: one run, one key length, in order
            for slot, key in zip(slots[picked].tolist(), found):
                keys[slot] = key
        offset += records.size
    return keys
