"""The shared-memory segment: one POSIX shm object per pool, its header and its NumPy views.

Theory of operation
-------------------
The daemon `create`s a segment at start and is the only writer of its header and generation
counters; workers `attach` it and write KV bytes only into blocks the daemon handed them. The
segment outlives the daemon (POSIX shm stays until unlinked), which is what crash recovery
re-attaches; a reboot removes it, and the boot id in the header tells a survivor from a stranger
with the same name.

Layout (all integers little-endian; the segment never leaves the host)::

    offset 0 ┌──────────────────────────────────────────────────────────────┐
             │ header, HEADER_NBYTES = 4096                                 │
             │   0  magic            8s   b"KVDSEG\\0\\1"                   │
             │   8  layout version   u32  LAYOUT_VERSION                    │
             │  12  header nbytes    u32  4096                              │
             │  16  segment uuid     16s  fresh per create                  │
             │  32  boot id          16s  /proc/sys/kernel/random/boot_id   │
             │  48  num_blocks, num_layers, block_size, num_kv_heads,       │
             │      head_dim         5×u64                                  │
             │  88  dtype code       u32  (DTYPE_CODES) + 4 bytes padding   │
             │  96  generations off  u64  = 4096                            │
             │ 104  pool offset      u64                                    │
             │ 112  total nbytes     u64  = file size                       │
             │ 120  zero up to 4088                                         │
             │4088  acknowledged seals u64  the journal's seal counter as   │
             │                              of its last commit (recovery)   │
       4096 ├──────────────────────────────────────────────────────────────┤
             │ generations: uint64[num_blocks], each at its own random base │
             │ per create; the daemon bumps block i's counter each time it  │
             │ goes back to FREE                                            │
  pool off  ├── aligned up to 4096 ─────────────────────────────────────────┤
             │ pool: (num_blocks, num_layers, 2, block_size, num_kv_heads,  │
             │        head_dim) of the storage dtype (bfloat16 as uint16)   │
      total └──────────────────────────────────────────────────────────────┘

Several pools (layout version 2, kvd/core/arena.py): the header holds the slab size and count
and a table of pools (name, block shape, dtype, window, id space, generations offset); each
pool's generations follow the header, then the data area of `num_slabs` slabs::

       0 ┌ header: magic, version 2, header nbytes, uuid, boot id, num_pools, slab nbytes,    ┐
         │ num_slabs, data offset, total nbytes; at 128: one 96-byte entry per pool         │
    4096 ├ pool 0's generations: uint64[num_ids(0)], pool 1's, ... (each 4096-aligned)      ┤
 data off├ slab 0 │ slab 1 │ ... │ slab num_slabs-1   (who owns a slab is the daemon's      ┤
         └─────────────────────────────────────────── business: addresses never change)  ┘

Pool P's block b lives at data offset + (b // bps) * slab nbytes + (b % bps) * block nbytes,
bps = slab nbytes // block nbytes: a view's address is static, whichever pool owns the slab now.
A single-pool daemon keeps layout version 1 above (its pool is named "default").

Creation reserves every page with `posix_fallocate` after checking `statvfs`: tmpfs happily
`ftruncate`s past its free space and then kills the first process that touches a missing page
with SIGBUS; reserving up front turns that into a NoSpaceError at start. The magic is written
last, so a daemon that dies half-way through `create` leaves a segment `attach` refuses.

Generations start at a random base (below 2**62, so they never wrap) rather than at 0: a reader
holding a block id and its generation from a replaced segment (a clean restart under the same
name) would otherwise see the same counter again on a block that now holds something else. The
base is drawn per block, not once per segment: a journal record (kvd/server/journal.py) whose
block id was damaged then names a block whose counter it cannot match, where with one shared base
every block that had been freed as often as the record's own matched it.

The acknowledged-seals counter at the end of the header is the daemon's: it writes the journal's
seal counter there after each commit and before the replies it holds (a store to shared memory),
so that a recovery knows how many seals were acknowledged and can say so when the journal it
reads ends sooner (kvd/server/recovery.py). A fresh segment has 0 there. Layout 2 has one per
pool (each pool has its own journal): pool n's is n * 8 bytes below the header's last 8, under
the pool table's end for MAX_SEGMENT_POOLS pools.

Views are `np.frombuffer` over the mmap, never copies. While any view lives the mmap cannot be
closed (BufferError), which is what keeps a reader off unmapped memory; `close` turns that into an
InUseError that says to drop the views first. Properties build a fresh view per call and the
segment keeps none itself, so the caller's references are the only ones.

A read-only attach (`attach(name, read_only=True)`, what `kvd.connect(..., read_only=True)`
uses) opens the object O_RDONLY and maps it PROT_READ: every view of it is read-only, so a
stray write raises (NumPy's ValueError; a raw pointer write faults) instead of changing a block
another process reads. A normal attach maps every block writable, whoever owns it: any process
of the daemon's uid can write any block (the trust model, README "Security").

Not `multiprocessing.shared_memory`: before Python 3.13 its resource tracker unlinks a segment
when any attaching process exits (CPython gh-82300).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import secrets
import struct
import uuid
from dataclasses import dataclass, replace
from types import TracebackType

import numpy as np
import posix_ipc

from kvd.errors import (
    BadArgsError, DeniedError, InUseError, NoSpaceError, NotFoundError, VersionError,
)
from kvd.geometry import Geometry
from kvd.runtime import SHM_DIR, squatter

MAGIC = b"KVDSEG\0\1"
LAYOUT_VERSION = 1
HEADER_NBYTES = 4096
PAGE_NBYTES = 4096
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
DTYPE_CODES = {"float16": 1, "float32": 2, "bfloat16": 3}  # 0 stays invalid: a zeroed header fails
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}

_HEADER = struct.Struct("<8sII16s16s5QI4xQQQ")
POOLS_LAYOUT_VERSION = 2
# magic, version, header nbytes, uuid, boot id, num_pools, slab nbytes, num_slabs, data offset,
# total nbytes; then at POOL_TABLE_OFFSET one _POOL_ENTRY per pool: name, num_layers, parts,
# block_size, num_kv_heads, head_dim, dtype code, window (0: none), num_ids, generations offset.
_POOLS_HEADER = struct.Struct("<8sII16s16sI4xQQQQ")
_POOL_ENTRY = struct.Struct("<32s6IQQQ8x")
POOL_TABLE_OFFSET = 128
MAX_SEGMENT_POOLS = 16
_ACKNOWLEDGED_SEALS = struct.Struct("<Q")
ACKNOWLEDGED_SEALS_OFFSET = HEADER_NBYTES - _ACKNOWLEDGED_SEALS.size  # the header's last 8 bytes
GENERATION_BASE_LIMIT = 1 << 62  # per-block random bases below it: 2**62 bumps before 2**63
_NAME_RE = re.compile(r"/kvd[A-Za-z0-9._-]{0,250}")


def current_boot_id() -> bytes:
    """This boot's id (16 bytes); it changes on every reboot."""
    with open(BOOT_ID_PATH, encoding="ascii") as file:
        return uuid.UUID(file.read().strip()).bytes


def check_name(name: str) -> str:
    """Return `name` if it is a valid segment name ("/kvd" + up to 250 of [A-Za-z0-9._-])."""
    if type(name) is not str or not _NAME_RE.fullmatch(name):
        raise BadArgsError(f"segment name must be '/kvd' followed by up to 250 letters, digits, "
                           f"'.', '_' or '-', got {name!r}")
    return name


def layout(geometry: Geometry) -> tuple[int, int, int]:
    """`(generations offset, pool offset, total nbytes)` of a segment for `geometry`."""
    generations_offset = HEADER_NBYTES
    pool_offset = _align_up(generations_offset + 8 * geometry.num_blocks, PAGE_NBYTES)
    return generations_offset, pool_offset, pool_offset + geometry.pool_nbytes


@dataclass(frozen=True)
class PoolLayout:
    """Where one pool's generations and blocks are. `geometry.num_blocks` is its id space."""

    name: str
    geometry: Geometry
    generations_offset: int
    data_offset: int
    slab_nbytes: int

    @property
    def blocks_per_slab(self) -> int:
        return self.slab_nbytes // self.geometry.block_nbytes

    def block_offset(self, block_id: int) -> int:
        slab, slot = divmod(block_id, self.blocks_per_slab)
        return self.data_offset + slab * self.slab_nbytes + slot * self.geometry.block_nbytes


def pools_layout(shapes: list[tuple[str, Geometry]], slab_nbytes: int,
                 num_slabs: int) -> tuple[list[PoolLayout], int]:
    """Each pool's PoolLayout (geometry with its id space) and the total nbytes, layout 2."""
    offset, layouts = HEADER_NBYTES, []
    for name, shape in shapes:
        geometry = replace(shape, num_blocks=num_slabs * (slab_nbytes // shape.block_nbytes))
        layouts.append(PoolLayout(name, geometry, offset, 0, slab_nbytes))
        offset = _align_up(offset + 8 * geometry.num_blocks, PAGE_NBYTES)
    layouts = [replace(each, data_offset=offset) for each in layouts]
    return layouts, offset + num_slabs * slab_nbytes


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def format_nbytes(nbytes: int) -> str:
    """Human-readable size: '64 MiB', '8.0 GiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            value = nbytes / (1 << shift)
            return f"{value:.1f} {unit}" if unit == "GiB" else f"{value:.0f} {unit}"
    return f"{nbytes} B"


def _check_free_space(total_nbytes: int) -> None:
    stat = os.statvfs(SHM_DIR)
    free_nbytes = stat.f_bavail * stat.f_frsize
    if total_nbytes > free_nbytes:
        raise NoSpaceError(_no_space_message(free_nbytes, total_nbytes))


def _no_space_message(free_nbytes: int, total_nbytes: int) -> str:
    return (f"{SHM_DIR} has {format_nbytes(free_nbytes)} free but the pool needs "
            f"{format_nbytes(total_nbytes)}: lower --num-blocks or enlarge {SHM_DIR}")


class Segment:
    """One mapped shared-memory segment. Build with `Segment.create` or `Segment.attach`."""

    def __init__(self, name: str, mapping: mmap.mmap, geometry: Geometry, segment_uuid: bytes,
                 boot_id: bytes, pools: list[PoolLayout] | None = None,
                 nbytes: int | None = None, is_read_only: bool = False) -> None:
        """`pools` and `nbytes` for layout 2 (then `geometry` is the first pool's);
        `is_read_only`: the mapping is PROT_READ (every view read-only)."""
        self._name = name
        self.is_read_only = is_read_only  # mapped PROT_READ: every view is read-only
        self._mmap: mmap.mmap | None = mapping
        self._geometry = geometry
        self._uuid = segment_uuid
        self._boot_id = boot_id
        self._generations_offset, self._pool_offset, self._nbytes = layout(geometry)
        if pools is None:
            pools = [PoolLayout("default", geometry, self._generations_offset, self._pool_offset,
                                geometry.block_nbytes)]
        else:
            self._nbytes = nbytes or 0
        self.is_multi_pool = nbytes is not None
        self.pools = {each.name: each for each in pools}
        # Cached because Geometry computes them with np.prod (µs each) and block() is per view.
        self._block_shape = geometry.block_shape
        self._block_nbytes = geometry.block_nbytes
        self._dtype = geometry.numpy_dtype
        self._is_unlinked = False

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, geometry: Geometry) -> Segment:
        """Create, reserve and map a new segment (mode 0600) and write its header.

        Raises:
            BadArgsError: bad name.
            NoSpaceError: /dev/shm cannot hold the segment (nothing is left behind).
            InUseError: a segment of that name already exists.
        """
        check_name(name)
        _, _, total_nbytes = layout(geometry)
        mapping, boot_id = _create_mapping(name, total_nbytes)
        segment = cls(name, mapping, geometry, uuid.uuid4().bytes, boot_id)
        segment._write_header(mapping)
        return segment

    @classmethod
    def create_pools(cls, name: str, shapes: list[tuple[str, Geometry]], slab_nbytes: int,
                     num_slabs: int) -> Segment:
        """Create a layout-2 segment for pools sharing `num_slabs` slabs (module docstring);
        raises as `create` does."""
        check_name(name)
        if len(shapes) > MAX_SEGMENT_POOLS:
            raise BadArgsError(f"a segment holds at most {MAX_SEGMENT_POOLS} pools")
        pools, total_nbytes = pools_layout(shapes, slab_nbytes, num_slabs)
        mapping, boot_id = _create_mapping(name, total_nbytes)
        segment = cls(name, mapping, pools[0].geometry, uuid.uuid4().bytes, boot_id, pools,
                      total_nbytes)
        segment._write_pools_header(mapping, slab_nbytes, num_slabs)
        return segment

    def _write_pools_header(self, mapping: mmap.mmap, slab_nbytes: int, num_slabs: int,
                            kept: dict[PoolLayout, tuple[np.ndarray, int]] | None = None) -> None:
        """`kept`: the generations and acknowledged seals of pools whose layout stays
        (`reshape_pools`); every other pool gets fresh random bases and 0 seals."""
        pools = list(self.pools.values())
        header = _POOLS_HEADER.pack(MAGIC, POOLS_LAYOUT_VERSION, HEADER_NBYTES, self._uuid,
                                    self._boot_id, len(pools), slab_nbytes, num_slabs,
                                    pools[0].data_offset, self._nbytes)
        rng = np.random.default_rng(secrets.randbits(128))  # (per-block bases, as in layout 1)
        for number, pool in enumerate(pools):
            g = pool.geometry
            _POOL_ENTRY.pack_into(
                mapping, POOL_TABLE_OFFSET + number * _POOL_ENTRY.size, pool.name.encode(),
                g.num_layers, g.parts, g.block_size, g.num_kv_heads, g.head_dim,
                DTYPE_CODES[g.dtype], g.window or 0, g.num_blocks, pool.generations_offset)
            generations = self.generations_of(pool.name)
            old = (kept or {}).get(replace(pool, generations_offset=0, data_offset=0))
            if old is None:
                generations[:] = rng.integers(0, GENERATION_BASE_LIMIT, generations.size,
                                              np.uint64)
            else:
                generations[:] = old[0]
            del generations
            self.set_pool_acknowledged_seals(pool.name, 0 if old is None else old[1])
        mapping[len(MAGIC):_POOLS_HEADER.size] = header[len(MAGIC):]
        mapping[:len(MAGIC)] = MAGIC

    @classmethod
    def reshape_pools(cls, segment: Segment, shapes: list[tuple[str, Geometry]]) -> Segment:
        """Rewrite the attached layout-2 `segment` (closed by this; no view of it may live) in
        place for the pools `shapes`, over the same slabs (size and count) and boot id, under a
        new uuid (a client's mapping of the old layout must not pass for current), and
        re-attach it. The data area moves to its new offset, bytes kept; a pool of the same name
        and geometry keeps its generations and acknowledged seals; any other gets fresh bases
        and 0 seals. The magic is cleared first, so a crash half-way leaves a segment `attach`
        refuses (the next start is clean).

        Raises:
            NoSpaceError: /dev/shm cannot hold the grown segment (it is left as it was).
        """
        first = next(iter(segment.pools.values()))
        slab_nbytes, old_data_offset, old_nbytes = (first.slab_nbytes, first.data_offset,
                                                    segment.nbytes)
        num_slabs = (old_nbytes - old_data_offset) // slab_nbytes
        kept = {replace(pool, generations_offset=0, data_offset=0):
                (segment.generations_of(name).copy(), segment.pool_acknowledged_seals(name))
                for name, pool in segment.pools.items()}
        pools, nbytes = pools_layout(shapes, slab_nbytes, num_slabs)
        name, boot_id = segment.name, segment.boot_id
        segment_uuid = uuid.uuid4().bytes  # (a client's mapping of the old layout is stale)
        segment.close()
        shm = posix_ipc.SharedMemory(name)
        try:
            if nbytes > old_nbytes:
                _check_free_space(nbytes - old_nbytes)
                mapping = _reserve_and_map(shm, nbytes)
            else:
                mapping = mmap.mmap(shm.fd, old_nbytes)
            try:
                mapping[:len(MAGIC)] = bytes(len(MAGIC))
                mapping.move(pools[0].data_offset, old_data_offset, num_slabs * slab_nbytes)
                mapping[POOL_TABLE_OFFSET:HEADER_NBYTES] = bytes(HEADER_NBYTES - POOL_TABLE_OFFSET)
                reshaped = cls(name, mapping, pools[0].geometry, segment_uuid, boot_id, pools,
                               nbytes)
                reshaped._write_pools_header(mapping, slab_nbytes, num_slabs, kept)
            finally:
                mapping.close()
            if nbytes < old_nbytes:
                os.ftruncate(shm.fd, nbytes)
        finally:
            shm.close_fd()
        return cls.attach(name)

    @classmethod
    def attach(cls, name: str, read_only: bool = False) -> Segment:
        """Map an existing segment and validate its header; `read_only`: map it PROT_READ.

        Raises:
            BadArgsError: bad name.
            NotFoundError: no segment of that name.
            DeniedError: the segment belongs to another user.
            VersionError: not a kvd segment, another layout version, or a corrupt header.
        """
        check_name(name)
        try:
            shm = posix_ipc.SharedMemory(name, read_only=read_only)
        except posix_ipc.ExistentialError:
            raise NotFoundError(f"no segment {name}: start the daemon (kvd start) or check "
                                "--name") from None
        except posix_ipc.PermissionsError:
            raise DeniedError(f"segment {name} belongs to another user: run as that user or "
                              "choose another --name") from None
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # shm_open will not follow a symlink planted at the name
                raise
            path = SHM_DIR + name
            raise squatter(path, os.lstat(path), "a kvd segment",
                           "choose another --name") from exc
        try:
            file_nbytes = os.fstat(shm.fd).st_size
            if file_nbytes < HEADER_NBYTES:
                raise VersionError(f"{name} is not a kvd segment ({file_nbytes} bytes, smaller "
                                   "than a header): unlink it or choose another --name")
            mapping = mmap.mmap(shm.fd, file_nbytes,
                                access=mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE)
        finally:
            shm.close_fd()
        try:
            if struct.unpack_from("<I", mapping, len(MAGIC))[0] == POOLS_LAYOUT_VERSION:
                pools, segment_uuid, boot_id = _read_pools_header(name, mapping)
                return cls(name, mapping, pools[0].geometry, segment_uuid, boot_id, pools,
                           len(mapping), is_read_only=read_only)
            return cls(name, mapping, *_read_header(name, mapping), is_read_only=read_only)
        except BaseException:
            mapping.close()
            raise

    def _write_header(self, mapping: mmap.mmap) -> None:
        geometry = self._geometry
        header = _HEADER.pack(
            MAGIC, LAYOUT_VERSION, HEADER_NBYTES, self._uuid, self._boot_id,
            geometry.num_blocks, geometry.num_layers, geometry.block_size,
            geometry.num_kv_heads, geometry.head_dim, DTYPE_CODES[geometry.dtype],
            self._generations_offset, self._pool_offset, self._nbytes,
        )
        generations = self.generations
        # (module docstring: "Generations start at a random base"), from a generator seeded by
        # the OS: a million bases in milliseconds, where os.urandom's would take tens.
        rng = np.random.default_rng(secrets.randbits(128))
        generations[:] = rng.integers(0, GENERATION_BASE_LIMIT, generations.size, np.uint64)
        del generations
        # The magic goes in last: a header without it is refused by `attach`.
        mapping[len(MAGIC):_HEADER.size] = header[len(MAGIC):]
        mapping[:len(MAGIC)] = MAGIC

    # --- views -----------------------------------------------------------------------------

    def _array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...],
               readonly: bool) -> np.ndarray:
        if self._mmap is None:
            raise InUseError(f"segment {self._name} is closed: attach it again")
        buffer = memoryview(self._mmap).toreadonly() if readonly else self._mmap
        count = math.prod(shape)
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)

    @property
    def generations(self) -> np.ndarray:
        """Per-block generation counters, uint64[num_blocks] (written by the daemon only)."""
        return self._array(self._generations_offset, np.dtype("<u8"),
                           (self._geometry.num_blocks,), readonly=False)

    @property
    def pool(self) -> np.ndarray:
        """Every block, writable: shape `geometry.pool_shape`, dtype `geometry.numpy_dtype`."""
        return self._array(self._pool_offset, self._geometry.numpy_dtype,
                           self._geometry.pool_shape, readonly=False)

    @property
    def pool_readonly(self) -> np.ndarray:
        """Every block, read-only (cannot be made writable again)."""
        return self._array(self._pool_offset, self._geometry.numpy_dtype,
                           self._geometry.pool_shape, readonly=True)

    def generations_of(self, pool: str) -> np.ndarray:
        """One pool's generation counters, uint64[its id space] (written by the daemon only)."""
        layout_ = self._pool_layout(pool)
        return self._array(layout_.generations_offset, np.dtype("<u8"),
                           (layout_.geometry.num_blocks,), readonly=False)

    def slabs_of(self, pool: str, readonly: bool = False) -> np.ndarray:
        """Every block of a pool as `(num_slabs, blocks_per_slab, *block_shape)`: block b is
        `[b // blocks_per_slab, b % blocks_per_slab]` (a slab's tail is not in the view)."""
        layout_ = self._pool_layout(pool)
        geometry, bps = layout_.geometry, layout_.blocks_per_slab
        data = self._array(layout_.data_offset, geometry.numpy_dtype,
                           ((self._nbytes - layout_.data_offset) // geometry.numpy_dtype.itemsize,),
                           readonly)
        inner = [geometry.numpy_dtype.itemsize]  # a block's C-order strides, last axis first
        for extent in reversed(geometry.block_shape[1:]):
            inner.insert(0, inner[0] * extent)
        return np.lib.stride_tricks.as_strided(
            data, (geometry.num_blocks // bps, bps, *geometry.block_shape),
            (layout_.slab_nbytes, geometry.block_nbytes, *inner), writeable=not readonly)

    def _pool_layout(self, pool: str) -> PoolLayout:
        layout_ = self.pools.get(pool)
        if layout_ is None:
            raise NotFoundError(f"segment {self._name} has no pool {pool!r}; it has "
                                f"{', '.join(self.pools)}")
        return layout_

    def block(self, block_id: int, readonly: bool = False) -> np.ndarray:
        """One block, shape `geometry.block_shape`, a view into shared memory (no copy)."""
        if type(block_id) is not int and not isinstance(block_id, np.integer):
            raise BadArgsError(f"block_id must be an int, got {block_id!r}")
        if not 0 <= block_id < self._geometry.num_blocks:
            raise BadArgsError(f"block_id must be in [0, {self._geometry.num_blocks}), "
                               f"got {block_id}")
        offset = self._pool_offset + int(block_id) * self._block_nbytes
        return self._array(offset, self._dtype, self._block_shape, readonly)

    @property
    def acknowledged_seals(self) -> int:
        """The journal's seal counter as of its last commit (module docstring); 0 when fresh."""
        return self.pool_acknowledged_seals(next(iter(self.pools)))

    @acknowledged_seals.setter
    def acknowledged_seals(self, value: int) -> None:
        self.set_acknowledged_seals(value)

    def set_acknowledged_seals(self, value: int) -> None:
        """The daemon's, after each journal commit (kvd/server/journal.py's `on_commit`)."""
        self.set_pool_acknowledged_seals(next(iter(self.pools)), value)

    def pool_acknowledged_seals(self, pool: str) -> int:
        """One pool's acknowledged seals (its journal's: layout 2 keeps one counter per pool,
        pool n's n * 8 bytes below the header's last 8)."""
        return int(_ACKNOWLEDGED_SEALS.unpack_from(self._open_mmap(), self._seals_offset(pool))[0])

    def set_pool_acknowledged_seals(self, pool: str, value: int) -> None:
        _ACKNOWLEDGED_SEALS.pack_into(self._open_mmap(), self._seals_offset(pool), value)

    def _seals_offset(self, pool: str) -> int:
        self._pool_layout(pool)  # (NotFoundError naming the pools)
        return ACKNOWLEDGED_SEALS_OFFSET - _ACKNOWLEDGED_SEALS.size * list(self.pools).index(pool)

    def _open_mmap(self) -> mmap.mmap:
        if self._mmap is None:
            raise InUseError(f"segment {self._name} is closed: attach it again")
        return self._mmap

    # --- identity --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def geometry(self) -> Geometry:
        return self._geometry

    @property
    def uuid(self) -> bytes:
        """16 random bytes chosen at create; recovery checks it against the journal."""
        return self._uuid

    @property
    def boot_id(self) -> bytes:
        """The boot id of the machine when the segment was created (16 bytes)."""
        return self._boot_id

    @property
    def nbytes(self) -> int:
        """Total size of the segment (header + generations + pool)."""
        return self._nbytes

    @property
    def is_closed(self) -> bool:
        return getattr(self, "_mmap", None) is None

    # --- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap. Idempotent; safe on a half-built object.

        Raises:
            InUseError: a NumPy view of the segment is still alive.
        """
        mapping = getattr(self, "_mmap", None)
        if mapping is None:
            return
        try:
            mapping.close()
        except BufferError as exc:
            raise InUseError(f"segment {self._name} still has live NumPy views (pool, block, "
                             "generations): drop all views before close") from exc
        self._mmap = None

    def unlink(self) -> None:
        """Remove the segment's name (memory is freed once every mapping is gone). Idempotent."""
        if getattr(self, "_is_unlinked", True):
            return
        self._is_unlinked = True
        try:
            posix_ipc.unlink_shared_memory(self._name)
        except posix_ipc.ExistentialError:
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.is_closed else format_nbytes(self._nbytes)
        return f"Segment({self._name!r}, {self._geometry}, {state})"


def _create_mapping(name: str, total_nbytes: int) -> tuple[mmap.mmap, bytes]:
    """A new shm object of `total_nbytes` (0600), reserved and mapped, and this boot's id."""
    _check_free_space(total_nbytes)
    boot_id = current_boot_id()
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    except posix_ipc.ExistentialError:
        raise InUseError(f"segment {name} already exists (a running daemon, or one that "
                         "crashed): recover it, or unlink it if no daemon uses it") from None
    try:
        mapping = _reserve_and_map(shm, total_nbytes)
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()  # the mapping keeps the memory; nothing needs the fd after mmap
    return mapping, boot_id


def _reserve_and_map(shm: posix_ipc.SharedMemory, total_nbytes: int) -> mmap.mmap:
    # posix_fallocate both sets the size and allocates every page, so a full /dev/shm fails here.
    try:
        os.posix_fallocate(shm.fd, 0, total_nbytes)
    except OSError as exc:
        stat = os.statvfs(SHM_DIR)
        raise NoSpaceError(_no_space_message(stat.f_bavail * stat.f_frsize, total_nbytes)
                           + f" ({exc.strerror})") from None
    return mmap.mmap(shm.fd, total_nbytes)


def _read_pools_header(name: str, mapping: mmap.mmap) -> tuple[list[PoolLayout], bytes, bytes]:
    """Validate a layout-2 header; return `(pools, uuid, boot id)`."""
    (magic, _, header_nbytes, segment_uuid, boot_id, num_pools, slab_nbytes, num_slabs,
     data_offset, total_nbytes) = _POOLS_HEADER.unpack_from(mapping, 0)
    if magic != MAGIC or header_nbytes != HEADER_NBYTES:
        raise VersionError(f"{name} is not a kvd segment (bad magic {magic!r}): unlink it or "
                           "choose another --name")
    if not 0 < num_pools <= MAX_SEGMENT_POOLS or not slab_nbytes:
        raise VersionError(f"{name} has a corrupt header ({num_pools} pools): unlink it")
    shapes = []
    for number in range(num_pools):
        (raw_name, num_layers, parts, block_size, num_kv_heads, head_dim, dtype_code, window,
         _, _) = _POOL_ENTRY.unpack_from(mapping, POOL_TABLE_OFFSET + number * _POOL_ENTRY.size)
        try:
            shapes.append((raw_name.rstrip(b"\0").decode(), Geometry(
                1, num_layers, block_size, num_kv_heads, head_dim,
                _DTYPE_NAMES.get(dtype_code, f"code {dtype_code}"), parts, window or None)))
        except (BadArgsError, UnicodeDecodeError) as exc:
            raise VersionError(f"{name} has a corrupt header ({exc}): unlink it") from None
    pools, expected_nbytes = pools_layout(shapes, slab_nbytes, num_slabs)
    if (expected_nbytes, pools[0].data_offset) != (total_nbytes, data_offset) \
            or total_nbytes != len(mapping):
        raise VersionError(f"{name} has a corrupt header (sizes do not add up): unlink it")
    return pools, segment_uuid, boot_id


def _read_header(name: str, mapping: mmap.mmap) -> tuple[Geometry, bytes, bytes]:
    """Validate the header of a mapped segment; return `(geometry, uuid, boot id)`."""
    (magic, version, header_nbytes, segment_uuid, boot_id, num_blocks, num_layers, block_size,
     num_kv_heads, head_dim, dtype_code, *offsets) = _HEADER.unpack_from(mapping, 0)
    if magic != MAGIC:
        raise VersionError(f"{name} is not a kvd segment (bad magic {magic!r}): unlink it or "
                           "choose another --name")
    if version != LAYOUT_VERSION or header_nbytes != HEADER_NBYTES:
        raise VersionError(f"{name} has segment layout version {version}, this kvd reads "
                           f"{LAYOUT_VERSION}: use the matching kvd version on both sides")
    try:
        geometry = Geometry(num_blocks, num_layers, block_size, num_kv_heads, head_dim,
                            _DTYPE_NAMES.get(dtype_code, f"code {dtype_code}"))
    except BadArgsError as exc:
        raise VersionError(f"{name} has a corrupt header ({exc}): unlink it") from None
    if tuple(offsets) != layout(geometry) or offsets[-1] != len(mapping):
        raise VersionError(f"{name} has a corrupt header (offsets {offsets}, expected "
                           f"{layout(geometry)}, file is {len(mapping)} bytes): unlink it")
    return geometry, segment_uuid, boot_id
