"""The Journal class alone: buffering, group commit, ordering of seals and evictions, rewrite,
stamp, injected write failures, failpoints and file hygiene. No daemon."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env
from kvd.errors import JournalError
from kvd.journal import FAILPOINTS, JOURNAL_FILENAME, Journal, failpoint
from kvd.pool import NO_PARENT


@pytest.fixture
def journal(tmp_path: Path):
    journal = Journal(tmp_path / "state")
    yield journal
    journal.close()


def reopened(journal: Journal) -> tuple[list[int], list[bytes]]:
    """(block ids, keys) a restarted daemon would load from the same directory."""
    other = Journal(journal.state_dir)
    try:
        rows = other.load()
    finally:
        other.close()
    return rows.block_ids.tolist(), rows.keys


def seal(journal: Journal, block_id: int, key: bytes) -> None:
    """Journal a chain head of generation 0 in the prefill tier."""
    journal.sealed(block_id, key, 0, NO_PARENT, 0, 0)


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


def test_sealed_then_evicted_in_one_commit_leaves_no_row(journal):
    # Regression: a client may pipeline seal + release while another allocation evicts the
    # block in the same loop iteration. The DELETEs ran before the INSERTs, so the row of an
    # evicted block survived and recovery restored its new owner's bytes under the old hash.
    seal(journal, 3, b"h3")
    journal.evicted(3)
    assert journal.num_pending == 2  # both changes count: the daemon holds both replies
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


def test_injected_write_failure_raises_journal_error_and_writes_nothing(journal, tmp_path,
                                                                         monkeypatch):
    fail_file = tmp_path / "fail"
    monkeypatch.setenv("KVD_JOURNAL_FAIL_FILE", str(fail_file))
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
    state_dir = tmp_path / "state" / "name"
    journal = Journal(state_dir)
    seal(journal, 1, b"x")
    journal.commit()
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((state_dir / JOURNAL_FILENAME).stat().st_mode) == 0o600
    journal.remove()
    assert not state_dir.exists()


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
    script = f"from kvd.journal import failpoint; failpoint({name!r}); print('survived')"
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
