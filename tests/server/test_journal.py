"""The Journal class alone: buffering, group commit, ordering of seals and evictions, rewrite,
stamp, injected write failures, failpoints and file hygiene. No daemon."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, child_env

import kvd.server.journal as journal_module
from kvd.errors import JournalError
from kvd.server.journal import FAILPOINTS, JOURNAL_FILENAME, Journal, failpoint
from kvd.core.pool import NO_PARENT, ORPHAN, IndexRows


@pytest.fixture
def journal(tmp_path: Path):
    journal = Journal(tmp_path / "state")
    yield journal
    journal.close()


def on_disk(state_dir: Path) -> IndexRows:
    """What a daemon restarted after a crash right now would load: the journal holds its files
    locked while open, so this loads a copy of them (the database and the WAL) as they are."""
    copy = Path(tempfile.mkdtemp(prefix="journal-copy-", dir=state_dir.parent))
    try:
        for suffix in ("", "-wal"):
            if (state_dir / f"{JOURNAL_FILENAME}{suffix}").exists():
                shutil.copy(state_dir / f"{JOURNAL_FILENAME}{suffix}", copy)
        other = Journal(copy)
        try:
            return other.load().rows
        finally:
            other.close()
    finally:
        shutil.rmtree(copy)


def reopened(journal: Journal) -> tuple[list[int], list[bytes]]:
    """(block ids, keys) a restarted daemon would load from the same directory."""
    rows = on_disk(journal.state_dir)
    return rows.block_ids.tolist(), rows.keys


_generations = itertools.count(1)


def seal(journal: Journal, block_id: int, key: bytes) -> None:
    """Journal a chain head in the prefill tier, at a generation above every earlier one (a
    block's rises each time it is freed; the journal drops a record that does not rise)."""
    journal.sealed([(block_id, key, next(_generations), NO_PARENT, 0, 0)])


def heads(block_ids: list[int], keys: list[bytes]) -> list[tuple]:
    """Rows for Journal.rewrite: chain heads of generation 0."""
    return [(block_id, key, 0, NO_PARENT, 0, 0) for block_id, key in zip(block_ids, keys)]


def test_nothing_is_written_before_commit_and_everything_after(journal):
    seal(journal, 3, b"h3")
    seal(journal, 1, b"h1")
    assert journal.is_dirty and journal.num_pending == 2
    assert reopened(journal) == ([], [])
    journal.commit()
    assert not journal.is_dirty and journal.num_pending == 0
    assert reopened(journal) == ([3, 1], [b"h3", b"h1"])  # seal order, not block order


def test_eviction_deletes_the_row(journal):
    seal(journal, 3, b"h3")
    seal(journal, 4, b"h4")
    journal.commit()
    journal.evicted(3)
    journal.commit()
    assert reopened(journal) == ([4], [b"h4"])


def test_evicted_then_resealed_in_one_commit_keeps_the_new_row(journal):
    seal(journal, 3, b"old")
    journal.commit()
    journal.evicted(3)
    seal(journal, 3, b"new")
    journal.commit()
    assert reopened(journal) == ([3], [b"new"])


def test_a_block_evicted_then_resealed_in_one_commit_needs_no_tombstone(journal):
    seal(journal, 3, b"old")
    journal.commit()
    journal.evicted(3)
    seal(journal, 3, b"new")
    journal.evicted(4)  # never journaled: its tombstone is written all the same
    journal.commit()
    assert journal.num_log_records == 3  # old, tombstone of 4, new
    assert reopened(journal) == ([3], [b"new"])


def test_sealed_then_evicted_in_one_commit_leaves_no_row(journal):
    # Regression: a client may pipeline seal + release while another allocation evicts the
    # block in the same loop iteration. The DELETEs ran before the INSERTs, so the row of an
    # evicted block survived and recovery restored its new owner's bytes under the old hash.
    seal(journal, 3, b"h3")
    journal.evicted(3)
    assert journal.num_pending == 2 and journal.num_seals_pending == 1  # the seal holds its reply
    journal.commit()
    assert reopened(journal) == ([], [])


def test_sealed_evicted_and_resealed_in_one_commit_keeps_the_last_seal(journal):
    seal(journal, 3, b"first")
    journal.evicted(3)
    seal(journal, 3, b"second")
    journal.commit()
    assert reopened(journal) == ([3], [b"second"])


def test_seal_order_continues_across_reopen(journal):
    seal(journal, 7, b"a")
    journal.commit()
    journal.close()  # a restart: the journal is locked while it is open
    other = Journal(journal.state_dir)
    try:
        seal(other, 2, b"b")
        other.commit()
    finally:
        other.close()
    assert reopened(journal) == ([7, 2], [b"a", b"b"])


def test_rewrite_replaces_every_row_and_drops_pending_changes(journal):
    seal(journal, 1, b"x")
    journal.commit()
    seal(journal, 2, b"pending")
    journal.rewrite(heads([5, 6], [b"five", b"six"]))
    assert not journal.is_dirty
    assert reopened(journal) == ([5, 6], [b"five", b"six"])
    seal(journal, 9, b"nine")  # later seals come after the rewritten ones
    journal.commit()
    assert reopened(journal) == ([5, 6, 9], [b"five", b"six", b"nine"])


def test_reset_records_the_stamp_and_forgets_blocks(journal):
    seal(journal, 1, b"x")
    journal.commit()
    stamp = {"layout_version": 1, "geometry": {"num_blocks": 4}, "boot_id": "ab"}
    journal.reset(stamp)
    assert journal.read_stamp() == stamp
    assert reopened(journal) == ([], [])
    journal.reset({"boot_id": "cd"})
    assert journal.read_stamp() == {"boot_id": "cd"}


def test_a_journal_of_the_previous_version_is_read_and_reset_into_this_ones_schema(tmp_path):
    """A version-3 journal (no chunk checksums, no stamp checksum) reads as a stamp of another
    version, which recovery refuses to restore; the clean start's reset then makes the log
    table in this version's schema, so commits work (a DELETE would have kept three columns)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    with contextlib.closing(sqlite3.connect(state_dir / JOURNAL_FILENAME)) as old:
        old.executescript("CREATE TABLE stamp (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                          "CREATE TABLE log (chunk_id INTEGER PRIMARY KEY, "
                          "key_width INTEGER NOT NULL, records BLOB NOT NULL);"
                          "INSERT INTO stamp VALUES ('journal_version', '3');")
        old.commit()
    with contextlib.closing(Journal(state_dir)) as journal:
        assert journal.read_stamp() == {"journal_version": 3}
        journal.reset({"journal_version": journal_module.JOURNAL_VERSION})
        seal(journal, 1, b"x")
        journal.commit()
        assert reopened(journal) == ([1], [b"x"])


def test_a_stamp_that_fails_its_checksum_cannot_be_read(journal):
    journal.reset({"journal_version": journal_module.JOURNAL_VERSION, "boot_id": "ab"})
    journal._db.execute("UPDATE stamp SET value = '\"ac\"' WHERE key = 'boot_id'")
    with pytest.raises(JournalError, match="checksum does not match"):
        journal.read_stamp()


def test_injected_write_failure_raises_journal_error_and_writes_nothing(tmp_path, monkeypatch):
    fail_file = tmp_path / "fail"
    monkeypatch.setenv("KVD_JOURNAL_FAIL_FILE", str(fail_file))  # read when the journal opens
    with contextlib.closing(Journal(tmp_path / "state")) as journal:
        seal(journal, 1, b"kept")
        journal.commit()  # the file does not exist yet: writes work
        fail_file.touch()
        seal(journal, 2, b"lost")
        with pytest.raises(JournalError, match="injected"):
            journal.commit()
        assert not journal.is_dirty  # the failed changes are dropped: the caller must rewrite
        with pytest.raises(JournalError):
            journal.rewrite(heads([1, 2], [b"kept", b"lost"]))
        assert reopened(journal) == ([1], [b"kept"])
        fail_file.unlink()
        journal.rewrite(heads([1, 2], [b"kept", b"lost"]))
        assert reopened(journal) == ([1, 2], [b"kept", b"lost"])


def test_files_are_private_and_remove_deletes_them(tmp_path):
    """Regression: journal.sqlite3-wal was created 0644 (SQLite gives it the database file's
    mode, and the database was made 0600 only after the schema's first write)."""
    state_dir = tmp_path / "state" / "name"
    old_umask = os.umask(0o022)
    try:
        journal = Journal(state_dir)
        seal(journal, 1, b"x")
        journal.commit()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    files = sorted(path.name for path in state_dir.iterdir())
    assert f"{JOURNAL_FILENAME}-wal" in files
    assert {name: stat.S_IMODE((state_dir / name).stat().st_mode) for name in files} == \
        {name: 0o600 for name in files}
    journal.remove()
    assert not state_dir.exists()


def test_reopening_makes_files_left_readable_private(tmp_path):
    """A journal an older kvd left with a 0644 WAL is made private when it is opened again."""
    state_dir = tmp_path / "state"
    journal = Journal(state_dir)
    seal(journal, 1, b"x")
    journal.commit()
    wal = state_dir / f"{JOURNAL_FILENAME}-wal"
    copies = {suffix: (state_dir / f"{JOURNAL_FILENAME}{suffix}").read_bytes()
              for suffix in ("", "-wal")}  # (a crash leaves the WAL: close would remove it)
    journal.close()
    for suffix, data in copies.items():
        path = state_dir / f"{JOURNAL_FILENAME}{suffix}"
        path.write_bytes(data)
        path.chmod(0o644)
    with contextlib.closing(Journal(state_dir)) as journal:
        assert stat.S_IMODE(wal.stat().st_mode) == 0o600
        assert stat.S_IMODE((state_dir / JOURNAL_FILENAME).stat().st_mode) == 0o600
        assert journal.load().rows.block_ids.tolist() == [1]


def test_remove_keeps_a_directory_holding_foreign_files(tmp_path):
    state_dir = tmp_path / "state"
    journal = Journal(state_dir)
    (state_dir / "notes.txt").write_text("not ours")
    journal.remove()
    assert sorted(os.listdir(state_dir)) == ["notes.txt"]


def test_unopenable_journal_is_a_journal_error(tmp_path):
    blocker = tmp_path / "state"
    blocker.mkdir()
    (blocker / JOURNAL_FILENAME).mkdir()  # a directory where the database file should be
    with pytest.raises(JournalError, match="cannot open the journal"):
        Journal(blocker)


@pytest.mark.parametrize("name", FAILPOINTS)
def test_failpoint_kills_the_process_only_when_named(name):
    script = f"from kvd.server.journal import failpoint; failpoint({name!r}); print('survived')"
    named = subprocess.run([sys.executable, "-c", script], env=child_env(KVD_FAILPOINT=name),
                           cwd=ROOT, capture_output=True, text=True)
    assert named.returncode == -9 and "survived" not in named.stdout
    other = subprocess.run([sys.executable, "-c", script],
                           env=child_env(KVD_FAILPOINT="some-other-point"), cwd=ROOT,
                           capture_output=True, text=True)
    assert other.returncode == 0 and "survived" in other.stdout


def test_failpoint_is_a_no_op_without_the_variable(monkeypatch):
    monkeypatch.delenv("KVD_FAILPOINT", raising=False)
    failpoint("before-commit")  # still alive


# ---- compaction -------------------------------------------------------------------------------

class ChurnModel:
    """Drives a Journal like a churning pool and remembers the rows recovery must return.

    Keys have mixed lengths (1, 5, 16, 64 bytes: several record widths in one log; not unique,
    which the journal need not care about) and mostly end in zero bytes, which a careless decoder
    strips.
    """

    def __init__(self, seed: int, num_blocks: int = 48) -> None:
        self.rng = random.Random(seed)
        self.num_blocks = num_blocks
        self.live: dict[int, tuple] = {}  # block id -> row, in seal order
        self.num_seals = 0
        self.num_changes = 0  # seals and evictions: about the records appended

    def step(self, journal: Journal) -> None:
        """Buffer a few seals and evictions (like one loop iteration), commit, then tidy."""
        for _ in range(self.rng.randrange(1, 12)):
            self.num_changes += 1
            block_id = self.rng.randrange(self.num_blocks)
            if block_id in self.live:
                journal.evicted(block_id)
                del self.live[block_id]
            else:
                self.num_seals += 1
                key = self.num_seals.to_bytes(64, "little")[:self.rng.choice([1, 5, 16, 16, 64])]
                parent = self.rng.choice([NO_PARENT, ORPHAN, *self.live])
                row = (block_id, key, self.num_seals, parent, self.num_seals * 7,
                       self.rng.randrange(2))
                journal.sealed([row])
                self.live[block_id] = row
        journal.commit()
        journal.tidy()  # as the daemon does, once the commit's replies are out

    def expected(self) -> list[tuple]:
        return list(self.live.values())


def loaded(state_dir: Path) -> list[tuple]:
    """Every row a restarted daemon would load, oldest seal first, as plain tuples."""
    rows = on_disk(state_dir)
    return list(zip(rows.block_ids.tolist(), rows.keys, rows.generations.tolist(),
                    rows.parents.tolist(), rows.parent_generations.tolist(), rows.tiers.tolist()))


COMPACTING = {"compact_factor": 1.5, "min_compact_records": 16, "compact_budget": 8}


@pytest.mark.parametrize("max_chunk_records", [4096, 5])
@pytest.mark.parametrize("seed", range(3))
def test_recovery_is_exact_across_compactions(tmp_path, monkeypatch, seed, max_chunk_records):
    monkeypatch.setattr(journal_module, "MAX_CHUNK_RECORDS", max_chunk_records)
    journal = Journal(tmp_path, **COMPACTING)
    model = ChurnModel(seed)
    try:
        for step in range(300):
            model.step(journal)
            if step % 25 == 0:
                assert loaded(tmp_path) == model.expected()
        assert loaded(tmp_path) == model.expected()
        # Compaction ran (the log is a fraction of what was appended) and kept it bounded.
        assert journal.num_log_records < model.num_changes / 4
        assert journal.num_log_records <= 1.5 * len(model.live) + 16 + 2 * 48 + max_chunk_records
    finally:
        journal.close()


def test_a_reopened_journal_compacts_what_an_earlier_one_wrote(tmp_path):
    journal = Journal(tmp_path)  # never compacts: the default threshold is far away
    model = ChurnModel(seed=7)
    for _ in range(200):
        model.step(journal)
    num_records = journal.num_log_records
    journal.close()
    journal = Journal(tmp_path, **COMPACTING)  # rebuilds its view of the log on first commit
    try:
        for _ in range(100):
            model.step(journal)
        assert journal.num_log_records < num_records / 2
        assert loaded(tmp_path) == model.expected()
    finally:
        journal.close()


def heals_and_compacts(journal: Journal, model: ChurnModel, fail_file: Path,
                       state_dir: Path) -> None:
    """Once writes work again, the journal re-reads its log, compacts it and replays exactly."""
    fail_file.unlink()
    for _ in range(100):
        model.step(journal)
    assert loaded(state_dir) == model.expected()


def test_a_rewrite_then_a_failed_commit_leave_a_log_that_compacts_correctly(tmp_path,
                                                                            monkeypatch):
    fail_file = tmp_path / "fail"
    monkeypatch.setenv("KVD_JOURNAL_FAIL_FILE", str(fail_file))
    journal = Journal(tmp_path / "state", **COMPACTING)
    model = ChurnModel(seed=3)
    try:
        for _ in range(50):
            model.step(journal)
        journal.rewrite(model.expected())
        fail_file.touch()
        seal(journal, 1000, b"lost")
        with pytest.raises(JournalError):
            journal.commit()
        heals_and_compacts(journal, model, fail_file, tmp_path / "state")
    finally:
        journal.close()


class Untidy:
    """A Journal whose upkeep never comes: steps of a ChurnModel only commit."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def __getattr__(self, name: str) -> object:
        return getattr(self.journal, name)

    def tidy(self) -> None:
        pass


def test_commit_leaves_compaction_to_tidy(tmp_path):
    journal = Journal(tmp_path, **COMPACTING)
    model = ChurnModel(seed=5)
    try:
        num_records = 0
        for _ in range(60):  # commits only, as before a reply: the log just grows
            model.step(Untidy(journal))
            assert journal.num_log_records > num_records
            num_records = journal.num_log_records
        for _ in range(20):
            journal.tidy()  # what the daemon runs once the replies are out
        assert journal.num_log_records < num_records / 2
        assert loaded(tmp_path) == model.expected()
    finally:
        journal.close()


def wal_nbytes(journal: Journal) -> int:
    wal = Path(f"{journal.path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_tidy_checkpoints_the_wal_so_it_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "CHECKPOINT_NBYTES", 256 << 10)  # read as journals open
    keys = [i.to_bytes(16, "little") for i in range(4000)]

    def churn(journal: Journal, tidy: bool) -> None:
        for start in range(0, len(keys), 16):  # 250 commits of 16 seals: ~1 MiB of WAL frames
            for block_id in range(start, start + 16):
                seal(journal, block_id, keys[block_id])
            journal.commit()
            if tidy:
                journal.tidy()

    with contextlib.closing(Journal(tmp_path / "tidied")) as journal:
        churn(journal, tidy=True)
        assert wal_nbytes(journal) < 2 * journal_module.CHECKPOINT_NBYTES
        assert len(on_disk(journal.state_dir).keys) == len(keys)
    with contextlib.closing(Journal(tmp_path / "untidied")) as journal:
        churn(journal, tidy=False)  # only SQLite's backstop checkpoints, at twice the size
        assert wal_nbytes(journal) > 2 * journal_module.CHECKPOINT_NBYTES


def test_a_failed_upkeep_raises_journal_error_and_loses_nothing(tmp_path, monkeypatch):
    fail_file = tmp_path / "fail"
    monkeypatch.setenv("KVD_JOURNAL_FAIL_FILE", str(fail_file))
    journal = Journal(tmp_path / "state", **COMPACTING)
    model = ChurnModel(seed=9)
    try:
        for _ in range(30):  # committed: the log grows past where compaction is due ...
            model.step(Untidy(journal))
        fail_file.touch()
        with pytest.raises(JournalError, match="injected"):
            journal.tidy()  # ... but its compaction step fails
        assert loaded(tmp_path / "state") == model.expected()
        heals_and_compacts(journal, model, fail_file, tmp_path / "state")
    finally:
        journal.close()


CRASHING_CHURN = """
import json, sys
sys.path[:0] = [{tests!r}, {tests_root!r}]
from test_journal import COMPACTING, ChurnModel
from kvd.server.journal import Journal
journal, model = Journal({state_dir!r}, **COMPACTING), ChurnModel(seed=11)
for _ in range(10_000):
    model.step(journal)  # its commit is durable before a compaction step starts
    print(json.dumps([[row[0], row[1].hex(), *row[2:]] for row in model.expected()]), flush=True)
"""


def test_crash_during_compaction_loses_nothing_committed(tmp_path):
    state_dir = tmp_path / "state"
    script = CRASHING_CHURN.format(tests=str(Path(__file__).parent), tests_root=str(ROOT / "tests"),
                                   state_dir=str(state_dir))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          check=False, text=True, env=child_env(KVD_FAILPOINT="mid-compaction"))
    assert done.returncode == -9, done.stderr  # it reached a compaction step and died in it
    lines = done.stdout.splitlines()
    # The step whose compaction crashed had committed its changes but printed nothing yet.
    journal = Journal(state_dir, **COMPACTING)
    rows = loaded(state_dir)
    assert len(lines) > 1
    printed = [(row[0], bytes.fromhex(row[1]), *row[2:]) for row in json.loads(lines[-1])]
    replayed = ChurnModel(seed=11)
    for _ in range(len(lines)):
        replayed.step(NullJournal())
    assert replayed.expected() == printed
    replayed.step(NullJournal())  # the step that crashed in its compaction
    assert rows == replayed.expected()
    try:
        for _ in range(100):  # the crashed compaction's chunks are still there, and compact
            replayed.step(journal)
        assert loaded(state_dir) == replayed.expected()
    finally:
        journal.close()


class NullJournal:
    """Stands in for a Journal to replay a ChurnModel's random choices without writing."""

    def sealed(self, rows: list[tuple]) -> None:
        pass

    def evicted(self, block_id: int) -> None:
        pass

    def commit(self) -> None:
        pass

    def tidy(self) -> None:
        pass
