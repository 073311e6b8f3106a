"""The write-ahead journal of the hash index: what lets a restarted daemon keep its KV blocks.

Theory of operation
-------------------
POSIX shared memory outlives the daemon, so after a crash every sealed block's bytes are still in
the segment; what dies is the in-memory map from content hash to block. The journal keeps that
map in SQLite (WAL mode, `synchronous=NORMAL`: a committed transaction survives the process
crashing — only an OS crash or power loss can lose the last commits, and those lose /dev/shm too).

    stamp(key, value)   journal/layout/hash versions, geometry, segment uuid, boot id
    blocks(block_id PK, hash, seal_seq, generation, parent, parent_generation, tier)
                        one row per *indexed* sealed block, with its place in the prefix tree

Generations make the rows self-checking: a block's generation changes whenever it is freed, so
recovery restores a row only if the segment still shows the generation the row recorded, and
links a child under its parent only if the parent is the same residency the child was sealed
under — a parent block evicted and reused for other content is never mistaken for the old one.

Write rule (what makes recovery trustworthy):
  * a seal is acknowledged only after its row is committed — otherwise a client could be told
    "sealed" for a block that recovery would not restore;
  * an eviction's DELETE is committed before the evicted block's new owner hears its id — the new
    owner overwrites the bytes, and a surviving row would then restore garbage under the old hash.
The daemon guarantees both by holding every reply of a loop iteration until `commit()` returns
(a group commit: one transaction per iteration however many clients sealed in it).

Only indexed seals are journaled: unsealed (OWNED) blocks and private duplicates die with their
sessions anyway, and old sessions' pins are dropped on recovery — every restored block is CACHED.

Failpoints: `KVD_FAILPOINT=<name>` makes the daemon SIGKILL itself at that point, so tests can
crash it exactly there: before-commit, after-commit-before-reply, mid-eviction, during-recovery.
`KVD_JOURNAL_FAIL_FILE=<path>` makes every journal write fail while that file exists.

A failed commit puts the daemon in fail-closed mode: it refuses allocations and seals with a
JOURNAL error (lookups, reads and releases go on), and about once a second tries to rewrite the
whole index; the first rewrite that succeeds ends the mode.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from operator import itemgetter
from pathlib import Path
from typing import Any

from kvd.errors import JournalError
from kvd.pool import IndexRows

_INSERT = "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?)"
FAILPOINTS = ("before-commit", "after-commit-before-reply", "mid-eviction", "during-recovery")
JOURNAL_FILENAME = "journal.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS stamp (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    block_id INTEGER PRIMARY KEY,
    hash BLOB NOT NULL,
    seal_seq INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    parent INTEGER NOT NULL,
    parent_generation INTEGER NOT NULL,
    tier INTEGER NOT NULL
);
"""
# Bumped whenever the schema changes: a journal of another version never matches the stamp.
JOURNAL_VERSION = 2


def _inject_failure() -> None:
    """Tests make journal writes fail while the file KVD_JOURNAL_FAIL_FILE names exists."""
    path = os.environ.get("KVD_JOURNAL_FAIL_FILE")
    if path and os.path.exists(path):
        raise sqlite3.OperationalError("disk I/O error (injected by KVD_JOURNAL_FAIL_FILE)")


def failpoint(name: str) -> None:
    """Crash this process (SIGKILL: no cleanup at all) if KVD_FAILPOINT names `name`."""
    if os.environ.get("KVD_FAILPOINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


class Journal:
    """The hash-index journal in `state_dir`. Writes are buffered until `commit()`."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = self.state_dir / JOURNAL_FILENAME
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise JournalError(f"cannot open the journal {self.path}: {exc}") from None
        os.chmod(self.path, 0o600)
        # Pending seals by block id: an eviction of a block sealed since the last commit drops
        # its seal here (the DELETEs run first, so a buffered INSERT would outlive the eviction).
        self._seals: dict[int, tuple[int, bytes, int, int, int, int, int]] = {}
        self._evictions: list[tuple[int]] = []
        self._num_pending = 0
        row = self._db.execute("SELECT COALESCE(MAX(seal_seq), 0) FROM blocks").fetchone()
        self._seal_seq = row[0]

    # ---- the pool observer interface (called from BlockPool) ------------------------------
    def sealed(self, block_id: int, key: Any, generation: int, parent: int,
               parent_generation: int, tier: int) -> None:
        self._seal_seq += 1
        self._seals[block_id] = (block_id, key, self._seal_seq, generation, parent,
                                 parent_generation, tier)
        self._num_pending += 1

    def evicted(self, block_id: int) -> None:
        failpoint("mid-eviction")
        self._seals.pop(block_id, None)
        self._evictions.append((block_id,))
        self._num_pending += 1

    # ---- committing ------------------------------------------------------------------------
    @property
    def is_dirty(self) -> bool:
        return self._num_pending > 0

    @property
    def num_pending(self) -> int:
        """Changes buffered since the last commit (grows whenever a handler touched the index)."""
        return self._num_pending

    def commit(self) -> None:
        """Write every buffered change in one transaction. Raises JournalError on failure."""
        if not self.is_dirty:
            return
        evictions, seals = self._evictions, list(self._seals.values())
        self._clear_pending()
        failpoint("before-commit")
        self._transaction(lambda: (
            # Evictions first: a block evicted and re-sealed in one iteration keeps its new row.
            self._db.executemany("DELETE FROM blocks WHERE block_id = ?", evictions),
            self._db.executemany(_INSERT, seals)))
        failpoint("after-commit-before-reply")

    def rewrite(self, rows: list[tuple[int, bytes, int, int, int, int]]) -> None:
        """Replace every row with `rows` — (block_id, key, generation, parent, parent_generation,
        tier), oldest first — after a failed commit lost some changes."""
        self._clear_pending()
        numbered = [(row[0], row[1], seq, *row[2:]) for seq, row in enumerate(rows, 1)]
        self._transaction(lambda: (self._db.execute("DELETE FROM blocks"),
                                   self._db.executemany(_INSERT, numbered)))
        self._seal_seq = len(numbered)

    def _clear_pending(self) -> None:
        self._seals, self._evictions, self._num_pending = {}, [], 0

    def _transaction(self, body: Any) -> None:
        try:
            _inject_failure()
            self._db.execute("BEGIN")
            body()
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise JournalError(f"journal write to {self.path} failed: {exc}") from None

    def _rollback(self) -> None:
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # no transaction was open: nothing to undo

    # ---- stamp and recovery ----------------------------------------------------------------
    def read_stamp(self) -> dict[str, Any]:
        rows = self._db.execute("SELECT key, value FROM stamp").fetchall()
        return {key: json.loads(value) for key, value in rows}

    def reset(self, stamp: dict[str, Any]) -> None:
        """Forget every block and record a new stamp (a clean start)."""
        self._clear_pending()
        self._db.execute("BEGIN")
        self._db.execute("DELETE FROM blocks")
        self._db.execute("DELETE FROM stamp")
        self._db.executemany("INSERT INTO stamp VALUES (?, ?)",
                             [(key, json.dumps(value)) for key, value in stamp.items()])
        self._db.execute("COMMIT")
        self._seal_seq = 0

    def load(self) -> IndexRows:
        """Every journaled block, oldest seal first."""
        # Reading in rowid order and sorting here is about twice as fast as ORDER BY seal_seq.
        rows = self._db.execute("SELECT block_id, hash, seal_seq, generation, parent, "
                                "parent_generation, tier FROM blocks").fetchall()
        rows.sort(key=itemgetter(2))
        columns = list(zip(*rows)) or [()] * 7
        block_ids, keys, _, generations, parents, parent_generations, tiers = map(list, columns)
        return IndexRows(block_ids, keys, generations, parents, parent_generations, tiers)

    def close(self) -> None:
        self._db.close()

    def remove(self) -> None:
        """Close and delete the journal files (a plain `kvd stop`)."""
        self.close()
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(f"{self.path}{suffix}")
            except FileNotFoundError:
                pass
        try:
            self.state_dir.rmdir()
        except OSError:
            pass  # not empty: it holds files that are not ours
