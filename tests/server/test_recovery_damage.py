"""A damaged journal never serves wrong bytes: flipped bits in journal.sqlite3 and its -wal.

The contract (kvd/server/recovery.py): whatever a flip does, `--recover` restores only blocks it
can prove -- a checksummed chunk, a generation the segment still shows -- drops the rest (a miss),
says in its log line what it dropped or lost, and sets aside what it could not read instead of
deleting it. Every block a test seals holds bytes derived from its hash (test_recovery's
`pattern`), so every hit after a recovery can be checked.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import daemon_name
from kvd.errors import JournalError, KvdError
from kvd.geometry import Geometry
from kvd.runtime import SHM_DIR, DaemonPaths
from kvd.server.daemon import DaemonConfig, Server, launch
from kvd.segment import HEADER_NBYTES
import kvd.server.journal as journal_module
from kvd.server.journal import JOURNAL_FILENAME, Journal
from test_recovery import pattern, remove_daemon_files, restartable  # noqa: F401  (a fixture)

# The geometry: 16 blocks of (1 layer, K/V, 4 tokens, 1 head, 8 dims) float32.
SMALL = {"num_blocks": 16, "layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": 4,
         "dtype": "float32"}
KEY_OFFSET_IN_RECORD = 35  # the key follows a record's 35 header bytes ...
BLOCK_ID_OFFSET_IN_RECORD = 24  # ... and its block id sits 11 bytes before it


def test_a_flipped_block_id_never_serves_another_blocks_bytes(restartable):
    """Regression (issue 34 item 1): seal 7.0 under b'H'*16, `kvd stop --keep`, flip one bit of
    the block id in its journal record, `kvd start --recover`: "1 of 1 journaled blocks restored"
    and the lookup returned block 1, holding 0.0. Now the record fails its checksum: dropped,
    counted and logged; the lookup misses."""
    daemon = restartable(**SMALL)
    daemon.start()
    key = b"H" * 16
    with daemon.connect() as client:
        (block_id,) = client.alloc(1)
        client.view(block_id)[...] = 7.0
        assert client.seal([block_id], [key]) == [True]
        client.release([block_id])
    daemon.stop_cli("--keep")
    data = bytearray(daemon.journal_path.read_bytes())
    at = data.index(key) - (KEY_OFFSET_IN_RECORD - BLOCK_ID_OFFSET_IN_RECORD)
    data[at] ^= 1  # block 0 <-> block 1
    daemon.journal_path.write_bytes(data)
    offset = daemon.recover()
    text = daemon.log(offset)
    assert "Traceback" not in text
    assert "1 of 1 journaled blocks restored" not in text
    assert "damaged" in text, text
    with daemon.connect() as client:
        found = client.lookup([key])
        try:
            for hit in found:  # a hit must hold the sealed bytes
                assert np.all(client.view(hit) == 7.0), f"block {hit} served under {key!r}"
        finally:
            client.release(found)
    daemon.stop_cli()


# ---- random flips, recovered in-process ------------------------------------------------------

FUZZ_GEOMETRY = Geometry(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8,
                         dtype="float32")


def block_pattern(key: bytes) -> np.ndarray:
    return pattern(key, FUZZ_GEOMETRY.block_nbytes)


class Images:
    """One daemon's state, saved twice: while it runs (journal.sqlite3 with commits still in its
    -wal, as a crash leaves them) and after `stop --keep` (all checkpointed into the database).
    Each image is the journal's files and the segment's bytes; `sealed` maps every hash ever
    sealed to its pattern's key, `num_indexed` is how many were indexed at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.paths = DaemonPaths.for_name(daemon_name("d"), str(tmp_path / "kvd.sock"))
        self.state = tmp_path / "state"
        self.segment_path = SHM_DIR + self.paths.segment_name
        self.sealed: list[bytes] = []
        daemon = launch(DaemonConfig(self.paths, FUZZ_GEOMETRY, state_dir=str(self.state)))
        try:
            self._churn(daemon)
            self.num_indexed = len(daemon.service.pool.tables.index)
            assert daemon.journal is not None
            self.running = self._save()
            assert "-wal" in self.running and len(self.running["-wal"]) > 0
        finally:
            daemon.stop(keep=True)
            daemon.serve_forever()
        self.stopped = self._save()
        assert "-wal" not in self.stopped

    def _churn(self, daemon: Server) -> None:
        """Chains of four sealed in batches, one commit each, a checkpoint half-way, and a full
        pool's evictions: chunks in the database and in the WAL, parents, tombstones; four
        blocks left FREE."""
        pool, journal = daemon.service.pool, daemon.journal
        assert journal is not None
        owner = daemon.service.open_session(os.getpid(), os.getuid()).session_id
        blocks = daemon.started.segment.pool.reshape(FUZZ_GEOMETRY.num_blocks, -1).view(np.uint8)
        for batch in range(12):
            block_ids = pool.allocate(8, owner)
            keys = [os.urandom(16) for _ in block_ids]
            for block_id, key in zip(block_ids, keys):
                blocks[block_id] = block_pattern(key)
            parents = [None if i % 4 == 0 else keys[i - 1] for i in range(len(keys))]
            pool.seal(block_ids, keys, owner, parents=parents)
            pool.release(block_ids, owner)
            journal.commit()
            self.sealed += keys
            if batch == 5:
                journal._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        block_ids = pool.allocate(4, owner)  # evicted, then FREE
        pool.release(block_ids, owner)
        journal.commit()

    def _save(self) -> dict[str, bytes]:
        image = {suffix: (self.state / f"{JOURNAL_FILENAME}{suffix}").read_bytes()
                 for suffix in ("", "-wal")
                 if (self.state / f"{JOURNAL_FILENAME}{suffix}").exists()}
        with open(self.segment_path, "rb") as file:
            image["segment"] = file.read()
        return image

    def put_back(self, image: dict[str, bytes]) -> None:
        """Make the state that of `image` again: its segment bytes, its journal files only."""
        shutil.rmtree(self.state, ignore_errors=True)
        self.state.mkdir(mode=0o700)
        for suffix, data in image.items():
            if suffix != "segment":
                (self.state / f"{JOURNAL_FILENAME}{suffix}").write_bytes(data)
        with open(self.segment_path, "r+b") as file:
            file.write(image["segment"])

    def cleanup(self) -> None:
        remove_daemon_files(self.paths, self.state)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    made = Images(tmp_path_factory.mktemp("flips"))
    yield made
    made.cleanup()


def flipped(image: dict[str, bytes], rng: random.Random) -> tuple[dict[str, bytes], list[str]]:
    """`image` with 1 to 3 random bits flipped anywhere in its journal files (the database and
    the -wal alike: each bit is as likely), and where."""
    files = [suffix for suffix in image if suffix != "segment"]
    data = {suffix: bytearray(image[suffix]) for suffix in files}
    total = sum(len(data[suffix]) for suffix in files)
    where = []
    for _ in range(rng.randint(1, 3)):
        bit = rng.randrange(8 * total)
        for suffix in files:
            if bit < 8 * len(data[suffix]):
                data[suffix][bit // 8] ^= 1 << bit % 8
                where.append(f"{JOURNAL_FILENAME}{suffix} byte {bit // 8} bit {bit % 8}")
                break
            bit -= 8 * len(data[suffix])
    return {**image, **{suffix: bytes(value) for suffix, value in data.items()}}, where


@contextlib.contextmanager
def kvd_log() -> Iterator[list[logging.LogRecord]]:
    """The records the "kvd" logger emits meanwhile."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("kvd")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


class Outcomes:
    """How the recoveries of a fuzz run ended (the test's report, and what it asserts on)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __str__(self) -> str:
        return ", ".join(f"{count} {name}" for name, count in sorted(self.counts.items()))


def recover_flipped(images: Images, image: dict[str, bytes], rng: random.Random,
                    outcomes: Outcomes, recover: bool = True) -> None:
    """Flip bits in `image`, recover it in-process (or start plainly, which must start: it
    forgets the blocks anyway), and check every hit's bytes."""
    damaged, where = flipped(image, rng)
    images.put_back(damaged)
    with kvd_log() as records:
        try:
            daemon = launch(DaemonConfig(images.paths, FUZZ_GEOMETRY,
                                         state_dir=str(images.state), recover=recover))
        except KvdError as exc:  # a typed refusal: it must say so, and keep the journal
            assert recover, (where, exc)
            outcomes.counts["refused"] += 1
            assert "journal" in str(exc), (where, exc)
            assert (images.state / JOURNAL_FILENAME).exists(), where
            return
    try:
        pool = daemon.service.pool
        blocks = daemon.started.segment.pool.reshape(FUZZ_GEOMETRY.num_blocks, -1).view(np.uint8)
        for key in images.sealed:
            block_id = pool.find(key)
            assert block_id is None or np.array_equal(blocks[block_id], block_pattern(key)), \
                f"wrong bytes served under {key.hex()} from block {block_id} after {where}"
        pool.check_invariants()
        assert not any(record.exc_info for record in records), where
        warnings = [record.getMessage() for record in records if record.levelno >= logging.WARNING]
        num_restored = daemon.started.num_restored
        if not recover:
            outcomes.counts["plain starts"] += 1
            return
        if num_restored < images.num_indexed:  # fewer than were acknowledged: it must say so
            assert any("damaged" in text or "starting clean" in text for text in warnings), \
                (where, num_restored, warnings)
        for aside in images.state.glob(f"{JOURNAL_FILENAME}.damaged-*"):  # named where it went
            assert any(str(aside).removesuffix("-wal") in text for text in warnings), where
        outcomes.counts["started clean" if any("starting clean" in text for text in warnings)
                        else "damage reported" if warnings
                        else "all restored" if num_restored == images.num_indexed
                        else "partial, silent"] += 1
    finally:
        daemon.stop(keep=True)
        daemon.serve_forever()


def run_flips(images: Images, num_cases: int, seed: int) -> Outcomes:
    rng, outcomes = random.Random(seed), Outcomes()
    for case in range(num_cases):
        recover_flipped(images, images.running if case % 2 else images.stopped, rng, outcomes,
                        recover=case % 10 != 9)
    return outcomes


def test_random_bit_flips_never_serve_wrong_bytes(images):
    """100 starts on journals with 1-3 random bits flipped, half with commits still in the WAL,
    one in ten a plain start: 0 wrong bytes, 0 tracebacks, every recovery that restored fewer
    blocks than were acknowledged says so (or is a typed refusal), every plain start starts."""
    outcomes = run_flips(images, 100, seed=34)
    print(f"100 flipped journals: {outcomes}")
    assert not outcomes.counts["partial, silent"]


@pytest.mark.slow
def test_random_bit_flips_never_serve_wrong_bytes_soak(images):
    outcomes = run_flips(images, 1000, seed=random.randrange(1 << 30))
    print(f"1000 flipped journals: {outcomes}")
    assert not outcomes.counts["partial, silent"]


# ---- what each kind of damage says --------------------------------------------------------------

def recover_in_process(images: Images) -> tuple[Server, list[str]]:
    """--recover in this process; the daemon and its warnings."""
    with kvd_log() as records:
        daemon = launch(DaemonConfig(images.paths, FUZZ_GEOMETRY, state_dir=str(images.state),
                                     recover=True))
    return daemon, [record.getMessage() for record in records if record.levelno >= logging.WARNING]


def stop_keeping(daemon: Server) -> None:
    daemon.stop(keep=True)
    daemon.serve_forever()


WAL_HEADER_NBYTES, WAL_FRAME_HEADER_NBYTES = 32, 24


def test_a_wal_that_lost_its_last_commit_says_how_many_acknowledged_seals_are_lost(images):
    """Regression: a damaged WAL frame makes SQLite drop it and every frame after it, silently:
    "24 of 24 journaled blocks restored" where 120 had been acknowledged. The segment's counter
    of acknowledged seals says how many the log lost: here the last batch's 8 (and the
    tombstones committed after them, which the generation check makes up for)."""
    wal = bytearray(images.running["-wal"])
    page_nbytes = int.from_bytes(wal[8:12], "big")
    # The frames of the WAL's current run (a checkpoint restarts it at the file's start, leaving
    # older frames, of another salt, beyond); a commit's last frame gives the database's size.
    frames = [at for at in range(WAL_HEADER_NBYTES, len(wal), WAL_FRAME_HEADER_NBYTES + page_nbytes)
              if wal[at + 8:at + 16] == wal[16:24]]
    commit_ends = [at for at in frames if int.from_bytes(wal[at + 4:at + 8], "big")]
    last_batch = frames[frames.index(commit_ends[-3]) + 1]  # the last batch's commit starts here
    wal[last_batch + WAL_FRAME_HEADER_NBYTES + 100] ^= 0x10  # its page: the checksum fails
    images.put_back({**images.running, "-wal": bytes(wal)})
    daemon, warnings = recover_in_process(images)
    try:
        (line,) = warnings
        assert "8 acknowledged seals lost" in line, line
        assert daemon.started.num_restored == images.num_indexed - 8
        aside = images.state / f"{JOURNAL_FILENAME}.damaged-1"
        assert f"kept as {aside}" in line
        assert (aside.with_name(aside.name + "-wal")).read_bytes() == bytes(wal)  # as it was
        num_restored = daemon.started.num_restored
    finally:
        stop_keeping(daemon)
    daemon, warnings = recover_in_process(images)  # the fresh journal: sound, and complete
    try:
        assert not warnings and daemon.started.num_restored == num_restored
    finally:
        stop_keeping(daemon)


def test_a_chunk_failing_its_checksum_drops_its_blocks_and_their_descendants(images):
    """A flipped bit in one chunk's records: that chunk's blocks and the chains below them are
    dropped (misses), everything else is restored, and the line counts the chunk."""
    data = bytearray(images.stopped[""])
    key = images.sealed[-8]  # the head of the last batch's first chain of four
    data[data.index(key) + 3] ^= 0x01
    images.put_back({**images.stopped, "": bytes(data)})
    daemon, warnings = recover_in_process(images)
    try:
        (line,) = warnings
        assert "1 of " in line and "chunks failed their checksum (8 records dropped)" in line
        pool = daemon.service.pool
        assert all(pool.find(key) is None for key in images.sealed[-8:])
        assert daemon.started.num_restored == images.num_indexed - 8
    finally:
        stop_keeping(daemon)


def test_a_journal_sqlite_cannot_open_is_refused_by_recover_and_set_aside_by_a_plain_start(images):
    """A journal whose file header is damaged ("file is not a database"): --recover refuses,
    naming what to do, and keeps it; a plain start (which forgets the blocks anyway) keeps a copy,
    says where, and starts with a new journal -- it used to fail to start at all."""
    data = bytearray(images.stopped[""])
    data[:16] = b"not a database!!"
    images.put_back({**images.stopped, "": bytes(data)})
    with pytest.raises(JournalError, match="start without --recover"):
        recover_in_process(images)
    assert (images.state / JOURNAL_FILENAME).read_bytes() == data
    with kvd_log() as records:
        daemon = launch(DaemonConfig(images.paths, FUZZ_GEOMETRY, state_dir=str(images.state)))
    try:
        aside = images.state / f"{JOURNAL_FILENAME}.damaged-1"
        assert any(f"kept as {aside}" in record.getMessage() for record in records)
        assert aside.read_bytes() == data
    finally:
        stop_keeping(daemon)


def appended(images: Images, rows: list[tuple[int, bytes, int, int, int, int]]) -> None:
    """The stopped image, with `rows` journaled after the rest (checksums and all)."""
    images.put_back(images.stopped)
    journal = Journal(images.state)
    journal.sealed(rows)
    journal.commit()
    journal.close()


def test_duplicate_claims_are_dropped_and_counted(images):
    """Records that pass every checksum but claim what another record holds: a block sealed
    again at a generation not above its last one, and a free block claiming a hash that a
    restored block holds. Neither is believed (a miss for each, never the other's bytes)."""
    generations = np.frombuffer(images.stopped["segment"], dtype="<u8", offset=HEADER_NBYTES,
                                count=FUZZ_GEOMETRY.num_blocks)
    images.put_back(images.stopped)
    daemon, _ = recover_in_process(images)
    try:
        held = {key: daemon.service.pool.find(key) for key in images.sealed}
        held = {key: block_id for key, block_id in held.items() if block_id is not None}
        free = daemon.service.pool.states().index(0)  # (its old record is a tombstone's)
    finally:
        stop_keeping(daemon)
    keys = list(held)
    key, other_key = keys[-4], keys[0]  # the last chain's head; a key of another chain
    block_id = held[key]
    appended(images, [(block_id, other_key, int(generations[block_id]), -1, 0, 0)])
    daemon, warnings = recover_in_process(images)
    try:
        assert "1 duplicate claims on a block or hash dropped" in warnings[0], warnings
        assert daemon.service.pool.find(other_key) == held[other_key]
        assert daemon.service.pool.find(key) is None  # its chain of three goes with it
        assert daemon.started.num_restored == images.num_indexed - 4
    finally:
        stop_keeping(daemon)
    appended(images, [(free, key, int(generations[free]), -1, 0, 0)])
    daemon, warnings = recover_in_process(images)
    try:
        assert "2 duplicate claims on a block or hash dropped" in warnings[0], warnings
        assert daemon.service.pool.find(key) is None
        assert daemon.started.num_restored == images.num_indexed - 4
    finally:
        stop_keeping(daemon)


def test_a_damaged_journal_that_cannot_be_copied_aside_is_refused_and_kept(images, monkeypatch):
    """Where the copy fails (a full state directory), the fresh journal would overwrite the
    damaged one: the start is refused instead, and segment and journal stay as they were."""
    data = bytearray(images.stopped[""])
    data[data.index(images.sealed[-1]) + 1] ^= 0x04
    images.put_back({**images.stopped, "": bytes(data)})

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_module.shutil, "copyfile", full)
    with pytest.raises(JournalError, match="kept as it was"):
        recover_in_process(images)
    assert (images.state / JOURNAL_FILENAME).read_bytes() == data
    assert not list(images.state.glob("*.damaged-*"))
    monkeypatch.undo()
    daemon, warnings = recover_in_process(images)  # with room again: recovered, set aside
    try:
        assert "1 of " in warnings[0] and "failed their checksum" in warnings[0]
    finally:
        stop_keeping(daemon)


def test_a_record_naming_another_block_cannot_match_its_generation(images):
    """Defence in depth, for damage a checksum missed: records that carry the generations of
    the blocks they were sealed in, moved to other blocks. With one base shared by all blocks
    (as generations were), every block freed as often matched; with a base per block none does."""
    generations = np.frombuffer(images.stopped["segment"], dtype="<u8", offset=HEADER_NBYTES,
                                count=FUZZ_GEOMETRY.num_blocks)
    moved = {os.urandom(16): block_id for block_id in range(FUZZ_GEOMETRY.num_blocks)}
    appended(images, [(block_id, key, int(generations[(block_id + 1) % len(generations)]), -1, 0,
                       0) for key, block_id in moved.items()])
    daemon, _ = recover_in_process(images)
    try:
        assert not any(daemon.service.pool.find(key) is not None for key in moved)
    finally:
        stop_keeping(daemon)
