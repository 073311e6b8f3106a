"""Crash recovery of a daemon of several pools (issue 31 item 7): one journal per pool, restored
together into the same segment; a pool whose geometry changed restarts clean (its slabs go back
to the arena) while the others keep their blocks; a removed pool is dropped, a new one starts
empty; flipped journal bits never serve wrong bytes in any pool.

Every sealed block holds bytes derived from its hash (test_recovery's `pattern`), in every pool.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvd
from conftest import daemon_name
from kvd.errors import KvdError
from kvd.runtime import SHM_DIR, DaemonPaths
from kvd.server.config import parse_pool_flag
from kvd.server.daemon import DaemonConfig, Server, launch
from kvd.core.pool import IndexRows
from kvd.segment import Segment
from kvd.server.journal import Damage, Loaded, pool_journal_filename
from kvd.server.recovery import drop_shared_slabs
from test_recovery import (
    Restartable, check_absent, check_invariants, check_present, pattern, remove_daemon_files,
    run_kill_cycles, seal_new,
)
from test_recovery_damage import Outcomes, flipped, kvd_log

pytestmark = pytest.mark.integration

# 1 KiB and 576-byte blocks sharing one budget.
TARGET = "target:layers=2,kv-heads=2,head-dim=8,dtype=float32,block-size=4"
LATENT = "latent:layers=3,parts=1,kv-heads=1,head-dim=24,dtype=bfloat16,block-size=4"
LATENT_CHANGED = "latent:layers=3,parts=1,kv-heads=1,head-dim=24,dtype=bfloat16,block-size=8"
DRAFT = "draft:layers=1,kv-heads=1,head-dim=8,dtype=float32,block-size=4"
MEMORY = 32 << 20


def pools_flags(*pools: str) -> tuple[str, ...]:
    return tuple(flag for pool in pools for flag in ("--pool", pool))


@pytest.fixture
def pools_daemon(tmp_path: Path) -> Iterator[Restartable]:
    """A Restartable of the pools target and latent sharing MEMORY."""
    daemon = Restartable(tmp_path, {"memory": MEMORY})
    daemon.flags = pools_flags(TARGET, LATENT)
    try:
        yield daemon
    finally:
        daemon.cleanup()


def seal_into(daemon, pool: str, count: int) -> dict[bytes, int]:
    """`count` blocks of `pool` sealed with their patterns and released: {hash: block id}."""
    with daemon.connect(pool=pool) as client:
        return seal_new(client, count)


def pool_stats(daemon, pool: str) -> dict:
    with daemon.connect(pool=pool) as client:
        return client.stats()["pools"][pool]


def check_fresh(daemon, pools: list[str]) -> None:
    """Right after --recover: nothing owned or pinned in any pool, every invariant holds."""
    for pool in pools:
        stats = pool_stats(daemon, pool)
        assert stats["owned"] == 0 and stats["sealed"] == 0, (pool, stats)
        assert stats["cached"] == stats["indexed"], (pool, stats)
    with daemon.connect() as client:
        check_invariants(client)


def test_acknowledged_seals_of_two_pools_survive_sigkill(pools_daemon, tmp_path):
    """Two workers per pool seal while the daemon is SIGKILLed at random moments, 8 times:
    after each --recover, every acknowledged seal of each pool is found with its bytes."""
    daemon = pools_daemon
    # 4 workers x 4000 blocks of at most 1 KiB: well inside 32 MiB, so nothing is evicted.
    run_kill_cycles(daemon, tmp_path, 8, num_workers=2, quota=4000, pools=("target", "latent"))


def test_the_restart_rules_hold_for_ops_naming_a_pool_or_a_model(pools_daemon):
    """The first call after a SIGKILL and --recover: `lookup`/`alloc`/`seq_open` addressed
    OP@POOL or OP@MODEL are sent again and `release`/`seq_close` are satisfied, as their plain
    forms are (they all raised DisconnectedError); the others still raise it."""
    daemon = pools_daemon
    daemon.flags = (*daemon.flags, "--model", "both:target,latent")
    daemon.start()
    sealed = seal_into(daemon, "latent", 4)
    keys, block_ids = list(sealed), list(sealed.values())
    clients = [daemon.connect(reconnect_timeout_s=30) for _ in range(5)]
    reader, releaser, sealer, sequencer, opener = clients
    try:
        pinned = releaser.lookup(keys, pool="latent")
        owned = sealer.alloc(2, pool="latent")
        seq = sequencer.open_model_sequence("both", list(range(9)))
        daemon.kill()
        daemon.recover()
        assert reader.lookup(keys, pool="latent") == block_ids  # sent again
        releaser.release(pinned, pool="latent")  # the restart dropped those pins: satisfied
        again = opener.open_model_sequence("both", list(range(9)))  # sent again
        with pytest.raises(kvd.DisconnectedError, match="restarted"):
            sealer.seal(owned, [os.urandom(16) for _ in owned], pool="latent")
        with pytest.raises(kvd.DisconnectedError):
            sequencer.extend_model_sequence(seq, [1])
        sequencer.close_model_sequence(seq)  # silently: the restart closed it
        assert [client.num_reconnects for client in clients] == [1] * 5
        opener.close_model_sequence(again)
        reader.release(block_ids, pool="latent")
        check_invariants(reader)
    finally:
        for client in clients:
            client.close()
    daemon.stop_cli()


def test_a_pool_whose_geometry_changed_restarts_clean_and_the_others_keep_theirs(pools_daemon):
    daemon = pools_daemon
    daemon.start()
    target, latent = seal_into(daemon, "target", 40), seal_into(daemon, "latent", 40)
    watcher = daemon.connect(pool="target", reconnect_timeout_s=30)
    check_present(watcher, target)  # (it maps the segment)
    daemon.kill()
    daemon.flags = pools_flags(TARGET, LATENT_CHANGED)
    offset = daemon.recover()
    text = daemon.log(offset)
    assert "pool latent changed geometry" in text, text
    # The segment was rewritten for the new pool table: a mapping of the old one must not pass
    # for current (the data area moved).
    with pytest.raises(kvd.DisconnectedError):
        watcher.lookup(list(target)[:1])
    watcher.close()
    check_fresh(daemon, ["target", "latent"])
    with daemon.connect(pool="target") as client:
        check_present(client, target)
    with daemon.connect(pool="latent") as client:
        assert client.geometry.block_size == 8
        check_absent(client, list(latent))
    # Its slabs went back to the arena: the changed pool owns none, the kept one only its own.
    assert pool_stats(daemon, "latent")["slabs"] == 0
    assert pool_stats(daemon, "target")["slabs"] >= 1
    latent = seal_into(daemon, "latent", 10)  # the changed pool works, and journals again
    daemon.kill()
    # The latent pool removed and a draft pool added: target keeps its blocks, draft is empty.
    daemon.flags = pools_flags(DRAFT, TARGET)
    offset = daemon.recover()
    text = daemon.log(offset)
    assert "pool latent is no longer configured" in text and "pool draft is new" in text, text
    assert not (daemon.state_dir / pool_journal_filename("latent")).exists()
    check_fresh(daemon, ["draft", "target"])
    with daemon.connect(pool="target") as client:
        check_present(client, target)
    assert pool_stats(daemon, "draft")["indexed"] == 0
    draft = seal_into(daemon, "draft", 5)
    daemon.stop_cli("--keep")
    daemon.recover()
    with daemon.connect(pool="draft") as client:
        check_present(client, draft)
    with daemon.connect(pool="target") as client:
        check_present(client, target)
    daemon.stop_cli()


# ---- flipped journal bits, two pools --------------------------------------------------------

FUZZ_POOLS = [parse_pool_flag(TARGET), parse_pool_flag(LATENT)]
FUZZ_MEMORY = 1 << 20  # ~1000 target blocks: the churn below evicts


class PoolImages:
    """One two-pool daemon's state after churn in both pools (parents, tombstones, slabs moving
    between the pools), saved with commits still in the -wal: each pool's journal files and the
    segment's bytes. `sealed[pool]` maps every hash sealed into `pool` to True."""

    def __init__(self, tmp_path: Path) -> None:
        self.paths = DaemonPaths.for_name(daemon_name("p"), str(tmp_path / "kvd.sock"))
        self.state = tmp_path / "state"
        self.segment_path = SHM_DIR + self.paths.segment_name
        self.sealed: dict[str, list[bytes]] = {"target": [], "latent": []}
        daemon = launch(self.config(False))
        try:
            self._churn(daemon)
            self.num_indexed = {name: len(served.pool.tables.index)
                                for name, served in daemon.service.served.items()}
            self.image = self._save()
        finally:
            daemon.stop(keep=True)
            daemon.serve_forever()

    def config(self, recover: bool) -> DaemonConfig:
        return DaemonConfig(self.paths, FUZZ_POOLS[0].shape, state_dir=str(self.state),
                            recover=recover, pools=tuple(FUZZ_POOLS), budget_nbytes=FUZZ_MEMORY)

    def _churn(self, daemon: Server) -> None:
        journal = daemon.journal
        assert journal is not None
        owner = daemon.service.open_session(os.getpid(), os.getuid()).session_id
        segment = daemon.started.segment
        for batch in range(24):
            name = ("target", "latent")[batch % 2]
            pool = daemon.service.served[name].pool
            block_ids = pool.allocate(64, owner)
            keys = [os.urandom(16) for _ in block_ids]
            slabs = segment.slabs_of(name)
            nbytes = segment.pools[name].geometry.block_nbytes
            for block_id, key in zip(block_ids, keys):
                slabs[divmod(block_id, pool.blocks_per_slab)].reshape(-1).view(np.uint8)[:] = \
                    pattern(key, nbytes)
            parents = [None if i % 4 == 0 else keys[i - 1] for i in range(len(keys))]
            pool.seal(block_ids, keys, owner, parents=parents)
            pool.release(block_ids, owner)
            journal.commit()
            self.sealed[name] += keys
        del slabs

    def _save(self) -> dict[str, bytes]:
        image = {path.name: path.read_bytes() for path in self.state.iterdir()}
        assert any(name.endswith("-wal") for name in image)
        with open(self.segment_path, "rb") as file:
            image["segment"] = file.read()
        return image

    def put_back(self, image: dict[str, bytes]) -> None:
        for path in self.state.iterdir():
            path.unlink()
        for name, data in image.items():
            if name != "segment":
                (self.state / name).write_bytes(data)
        with open(self.segment_path, "r+b") as file:
            file.write(image["segment"])

    def cleanup(self) -> None:
        remove_daemon_files(self.paths, self.state)


@pytest.fixture(scope="module")
def pool_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolImages]:
    made = PoolImages(tmp_path_factory.mktemp("poolflips"))
    yield made
    made.cleanup()


def recover_flipped_pools(images: PoolImages, rng: random.Random, outcomes: Outcomes) -> None:
    damaged, where = flipped(images.image, rng)
    images.put_back(damaged)
    with kvd_log() as records:
        try:
            daemon = launch(images.config(True))
        except KvdError as exc:  # a typed refusal: it must say so, and keep the journals
            outcomes.counts["refused"] += 1
            assert "journal" in str(exc), (where, exc)
            return
    try:
        segment = daemon.started.segment
        warnings = [record.getMessage() for record in records if record.levelno >= logging.WARNING]
        assert not any(record.exc_info for record in records), where
        for name, served in daemon.service.served.items():
            pool = served.pool
            slabs = segment.slabs_of(name)
            nbytes = segment.pools[name].geometry.block_nbytes
            for key in images.sealed[name]:
                block_id = pool.find(key)
                assert block_id is None or np.array_equal(
                    slabs[divmod(block_id, pool.blocks_per_slab)].reshape(-1).view(np.uint8),
                    pattern(key, nbytes)), \
                    f"wrong bytes served under {key.hex()} from {name} block {block_id} ({where})"
            del slabs
            if len(pool.tables.index) < images.num_indexed[name]:  # fewer: it must say so
                assert any(name in text or "starting clean" in text for text in warnings), \
                    (where, name, warnings)
        pool.arena.check_invariants()
        outcomes.counts["damage reported" if warnings else "all restored"] += 1
    finally:
        daemon.stop(keep=True)
        daemon.serve_forever()


def test_random_bit_flips_in_two_pools_journals_never_serve_wrong_bytes(pool_images):
    """60 recoveries of two pools' journals with 1-3 random bits flipped anywhere in their
    files: 0 wrong bytes in either pool, 0 tracebacks, every pool that restored fewer blocks
    than were indexed says so (or the start is a typed refusal)."""
    rng, outcomes = random.Random(31), Outcomes()
    for _ in range(60):
        recover_flipped_pools(pool_images, rng, outcomes)
    print(f"60 flipped two-pool journals: {outcomes}")
    assert outcomes.counts["damage reported"], outcomes


def test_a_slab_claimed_by_two_pools_drops_both_claims(tmp_path):
    """Two pools' journals whose current records put blocks in one slab: which to believe is
    unknown, so that slab's records go from both, counted as damage; the rest stays."""
    shapes = [(spec.name, spec.shape) for spec in FUZZ_POOLS]
    name = f"/kvd-test-{daemon_name('s')}"
    segment = Segment.create_pools(name, shapes, slab_nbytes=4096, num_slabs=8)
    try:
        loaded = {}
        for pool, block_ids in (("target", [0, 1, 4, 8]), ("latent", [7, 14, 15])):
            bps = segment.pools[pool].blocks_per_slab  # target 4, latent 7
            generations = segment.generations_of(pool)
            rows = IndexRows(block_ids, [os.urandom(16) for _ in block_ids],
                             generations[block_ids].tolist(), [-1] * len(block_ids),
                             [0] * len(block_ids), [0] * len(block_ids))
            loaded[pool] = Loaded(rows, 0, Damage())
            del generations
            assert bps in (4, 7)
        # target's slabs 0, 1, 2; latent's 1 (id 7) and 2 (ids 14, 15): slabs 1 and 2 shared.
        kept = drop_shared_slabs(segment, loaded)
        assert list(kept["target"].rows.block_ids) == [0, 1]
        assert list(kept["latent"].rows.block_ids) == []
        assert kept["target"].damage.shared_slabs == 2
        assert kept["latent"].damage.shared_slabs == 3
        assert "another pool's journal claims" in kept["target"].damage.describe()[0]
    finally:
        segment.close()
        segment.unlink()

