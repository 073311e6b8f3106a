"""The shared-memory segment: cross-process views, header validation, space checks, cleanup."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

import kvd.segment
from kvd.errors import BadArgsError, InUseError, NoSpaceError, NotFoundError, VersionError
from kvd.geometry import Geometry
from kvd.segment import HEADER_NBYTES, MAGIC, Segment, current_boot_id, layout

REPO = Path(__file__).resolve().parents[2]
PREFIX = "kvd-test-seg-"
SMALL = Geometry(num_blocks=5, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
HUGE = Geometry(num_blocks=1_000_000)  # 512 KiB blocks: ~488 GiB, far above any /dev/shm here


def leftover_names() -> set[str]:
    return {entry for entry in os.listdir("/dev/shm") if entry.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = leftover_names()
    yield
    leaked = leftover_names() - before
    for entry in leaked:  # clean up so one leak does not fail every later test
        posix_ipc.unlink_shared_memory("/" + entry)
    assert not leaked, f"test left segments in /dev/shm: {sorted(leaked)}"


@pytest.fixture
def name() -> str:
    return f"/{PREFIX}{uuid.uuid4().hex}"


@pytest.fixture
def segment(name):
    created = Segment.create(name, SMALL)
    yield created
    created.close()
    created.unlink()


def raw_write(name: str, offset: int, data: bytes) -> None:
    """Write bytes into a segment behind kvd's back (to forge headers)."""
    shm = posix_ipc.SharedMemory(name)
    with mmap.mmap(shm.fd, shm.size) as raw:
        raw[offset:offset + len(data)] = data
    shm.close_fd()


CHILD = """
import sys
import numpy as np
from kvd.segment import Segment
segment = Segment.attach(sys.argv[1])
pool = segment.pool
print(segment.uuid.hex(), int(pool.astype(np.int64).sum()), int(segment.generations[3]))
pool[1] = 7
del pool
segment.close()
"""


def test_separate_process_sees_and_writes_the_same_bytes(segment, name):
    pool = segment.pool
    pool[:] = np.arange(pool.size, dtype=np.int64).reshape(pool.shape) % 1000
    segment.generations[3] = 42
    expected_sum = int(pool.astype(np.int64).sum())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True,
                           env=env, timeout=60, check=True)
    assert child.stdout.split() == [segment.uuid.hex(), str(expected_sum), "42"]
    assert (pool[1] == 7).all() and pool[0, 0, 0, 0, 0, 1] == 1
    del pool
    # The child's exit must not unlink the segment (the multiprocessing.shared_memory pitfall).
    with Segment.attach(name) as again:
        assert again.uuid == segment.uuid and (again.block(1) == 7).all()


def test_attach_reads_geometry_and_stamp(segment, name):
    with Segment.attach(name) as attached:
        assert attached.geometry == SMALL
        assert attached.uuid == segment.uuid and len(attached.uuid) == 16
        assert attached.boot_id == current_boot_id() == segment.boot_id
        assert attached.nbytes == segment.nbytes == os.stat("/dev/shm" + name).st_size


def test_two_creates_get_different_uuids(segment, name):
    other_name = name + "-b"
    with Segment.create(other_name, SMALL) as other:
        assert other.uuid != segment.uuid
        other.unlink()


def test_generations_start_at_a_fresh_base_per_create(name):
    """A stale (block id, generation) from a replaced segment of the same name must not match
    the new segment's counter, or a reader would take another's bytes for its own."""
    bases = set()
    for _ in range(3):
        fresh = Segment.create(name, SMALL)
        bases.add(int(fresh.generations[0]))
        fresh.close()
        fresh.unlink()
    assert len(bases) == 3


def test_layout_and_views(segment):
    generations_offset, pool_offset, total = layout(SMALL)
    assert generations_offset == HEADER_NBYTES and pool_offset % 4096 == 0
    assert total == pool_offset + SMALL.pool_nbytes == segment.nbytes
    generations, pool = segment.generations, segment.pool
    assert generations.dtype == np.uint64 and generations.shape == (5,)
    # A random base per block, below 2**62 so it never wraps.
    assert len(set(generations.tolist())) == 5 and generations.max() < 1 << 62
    assert pool.shape == SMALL.pool_shape and pool.dtype == np.float16 and not pool.any()
    block = segment.block(2)
    block[...] = 1.5
    assert block.shape == SMALL.block_shape and np.shares_memory(block, pool)
    assert (pool[2] == 1.5).all() and not pool[1].any() and not pool[3].any()
    assert segment.block(np.int64(4)).shape == SMALL.block_shape


def test_bfloat16_is_stored_as_uint16_and_float32_as_float32(name):
    for dtype, expected in (("bfloat16", np.uint16), ("float32", np.float32)):
        geometry = Geometry(num_blocks=3, num_layers=1, block_size=2, num_kv_heads=1,
                            head_dim=4, dtype=dtype)
        with Segment.create(name + dtype, geometry) as created:
            created.unlink()
            assert created.pool.dtype == expected and created.block(0).dtype == expected
            pool_nbytes = 3 * 2 * 2 * 4 * np.dtype(expected).itemsize
            assert created.nbytes == layout(geometry)[1] + pool_nbytes


@pytest.mark.parametrize("bad_id", [-1, 5, 2**70, 1.0, True, "0"])
def test_block_id_is_checked(segment, bad_id):
    with pytest.raises(BadArgsError, match="block_id"):
        segment.block(bad_id)


def test_readonly_views_cannot_be_written(segment):
    segment.block(0)[...] = 3
    for view in (segment.pool_readonly, segment.block(0, readonly=True)):
        assert (view[..., 0] == 3).any()
        with pytest.raises(ValueError):
            view[...] = 0
        with pytest.raises(ValueError):
            view.flags.writeable = True


def test_close_with_a_live_view_raises_until_the_view_is_dropped(segment):
    for make_view in (lambda: segment.pool, lambda: segment.block(1),
                      lambda: segment.generations, lambda: segment.pool_readonly):
        view = make_view()
        with pytest.raises(InUseError, match="drop all views before close"):
            segment.close()
        assert not segment.is_closed
        del view
    segment.close()
    segment.close()  # idempotent
    assert segment.is_closed
    with pytest.raises(InUseError, match="closed"):
        segment.pool


def test_mode_is_0600(segment, name):
    assert os.stat("/dev/shm" + name).st_mode & 0o777 == 0o600


def test_unlink_is_idempotent_and_mapping_outlives_the_name(name):
    segment = Segment.create(name, SMALL)
    segment.block(0)[...] = 2
    segment.unlink()
    segment.unlink()
    with pytest.raises(NotFoundError, match="kvd start"):
        Segment.attach(name)
    assert (segment.block(0) == 2).all()  # the mapping stays valid until close
    segment.close()


def test_half_built_segment_closes_and_unlinks_quietly():
    half = Segment.__new__(Segment)
    half.close()
    half.unlink()
    assert half.is_closed


def test_create_over_an_existing_name_is_refused(segment, name):
    with pytest.raises(InUseError, match="already exists"):
        Segment.create(name, SMALL)
    with Segment.attach(name) as attached:  # the refused create left the first one intact
        assert attached.uuid == segment.uuid


def test_attach_missing_segment(name):
    with pytest.raises(NotFoundError, match="no segment"):
        Segment.attach(name)


@pytest.mark.parametrize("bad_name", ["kvd-x", "/other", "/kvd/x", "/kvd x", "/kvd" + "x" * 251,
                                      b"/kvd-x", None])
def test_bad_names_are_refused(bad_name):
    with pytest.raises(BadArgsError, match="segment name"):
        Segment.create(bad_name, SMALL)
    with pytest.raises(BadArgsError, match="segment name"):
        Segment.attach(bad_name)


def test_too_large_pool_is_refused_before_anything_is_created(name):
    with pytest.raises(NoSpaceError) as info:
        Segment.create(name, HUGE)
    message = str(info.value)
    assert re.fullmatch(r"/dev/shm has \S+ \S+ free but the pool needs \S+ GiB: "
                        r"lower --num-blocks or enlarge /dev/shm", message), message
    assert not Path("/dev/shm" + name).exists()


def test_failed_reservation_unlinks_the_segment(name, monkeypatch):
    """If space vanishes between the statvfs check and the reservation (another process took
    it), posix_fallocate fails; simulated by skipping the check for a pool tmpfs cannot hold."""
    monkeypatch.setattr(kvd.segment, "_check_free_space", lambda nbytes: None)
    with pytest.raises(NoSpaceError, match="lower --num-blocks or enlarge /dev/shm"):
        Segment.create(name, HUGE)
    assert not Path("/dev/shm" + name).exists()


# --- header validation ---------------------------------------------------------------------------

FORGERIES = {
    "bad magic": (0, b"NOTKVD\0\1"),
    "layout version 2": (8, (2).to_bytes(4, "little")),
    "header nbytes": (12, (8192).to_bytes(4, "little")),
    "zero num_blocks": (48, bytes(8)),
    "more blocks than the file": (48, (6).to_bytes(8, "little")),
    "dtype code 0": (88, bytes(4)),
    "dtype code 9": (88, (9).to_bytes(4, "little")),
    "pool offset": (104, (3 * 4096).to_bytes(8, "little")),
    "total nbytes": (112, (1 << 20).to_bytes(8, "little")),
}


@pytest.mark.parametrize("offset,data", FORGERIES.values(), ids=FORGERIES.keys())
def test_forged_headers_are_refused(segment, name, offset, data):
    raw_write(name, offset, data)
    with pytest.raises(VersionError, match="unlink it|matching kvd version"):
        Segment.attach(name)


def test_foreign_and_half_created_segments_are_refused(name):
    for nbytes in (100, 3 * HEADER_NBYTES):  # smaller than a header; all zero (no magic yet)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
        shm.close_fd()
        try:
            with pytest.raises(VersionError, match="not a kvd segment"):
                Segment.attach(name)
        finally:
            shm.unlink()


def test_header_starts_with_magic(segment, name):
    shm = posix_ipc.SharedMemory(name)
    with mmap.mmap(shm.fd, HEADER_NBYTES) as raw:
        assert raw[:8] == MAGIC
        assert raw[16:32] == segment.uuid and raw[32:48] == segment.boot_id
    shm.close_fd()


def test_current_boot_id_is_stable():
    assert current_boot_id() == current_boot_id() and len(current_boot_id()) == 16


def test_a_pools_segment_round_trips_its_table_and_places_blocks_by_slab(name):
    shapes = [("target", Geometry(1, num_layers=2, head_dim=8, num_kv_heads=2)),
              ("latent", Geometry(1, num_layers=3, parts=1, num_kv_heads=1, head_dim=24,
                                  dtype="bfloat16", window=64))]
    slab = 3 * shapes[0][1].block_nbytes + 100
    created = Segment.create_pools(name, shapes, slab, 5)
    try:
        attached = Segment.attach(name)
        assert attached.pools == created.pools and attached.is_multi_pool
        latent = attached.pools["latent"]
        assert latent.geometry.window == 64 and latent.geometry.parts == 1
        bps = latent.blocks_per_slab
        assert latent.geometry.num_blocks == 5 * bps
        slabs = attached.slabs_of("latent")
        slabs[1, 1][...] = 7  # block bps + 1 of the latent pool, written through one mapping
        offset = latent.block_offset(bps + 1)
        assert offset == latent.data_offset + slab + latent.geometry.block_nbytes
        raw = created.slabs_of("latent", readonly=True)
        assert (raw[1, 1] == 7).all() and (raw[1, 0] == 0).all()
        assert created.generations_of("target").shape == (5 * 3,)
        with pytest.raises(NotFoundError, match="no pool 'draft'"):
            attached.slabs_of("draft")
        del slabs, raw
        attached.close()
    finally:
        created.close()
        created.unlink()
