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
reads ends sooner (kvd/server/recovery.py). A fresh segment has 0 there.

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
                 boot_id: bytes, is_read_only: bool = False) -> None:
        self._name = name
        self.is_read_only = is_read_only  # mapped PROT_READ: every view is read-only
        self._mmap: mmap.mmap | None = mapping
        self._geometry = geometry
        self._uuid = segment_uuid
        self._boot_id = boot_id
        self._generations_offset, self._pool_offset, self._nbytes = layout(geometry)
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
        segment = cls(name, mapping, geometry, uuid.uuid4().bytes, boot_id)
        segment._write_header(mapping)
        return segment

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
        if self._mmap is None:
            raise InUseError(f"segment {self._name} is closed: attach it again")
        return int(_ACKNOWLEDGED_SEALS.unpack_from(self._mmap, ACKNOWLEDGED_SEALS_OFFSET)[0])

    @acknowledged_seals.setter
    def acknowledged_seals(self, value: int) -> None:
        self.set_acknowledged_seals(value)

    def set_acknowledged_seals(self, value: int) -> None:
        """The daemon's, after each journal commit (kvd/server/journal.py's `on_commit`)."""
        if self._mmap is None:
            raise InUseError(f"segment {self._name} is closed: attach it again")
        _ACKNOWLEDGED_SEALS.pack_into(self._mmap, ACKNOWLEDGED_SEALS_OFFSET, value)

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


def _reserve_and_map(shm: posix_ipc.SharedMemory, total_nbytes: int) -> mmap.mmap:
    # posix_fallocate both sets the size and allocates every page, so a full /dev/shm fails here.
    try:
        os.posix_fallocate(shm.fd, 0, total_nbytes)
    except OSError as exc:
        stat = os.statvfs(SHM_DIR)
        raise NoSpaceError(_no_space_message(stat.f_bavail * stat.f_frsize, total_nbytes)
                           + f" ({exc.strerror})") from None
    return mmap.mmap(shm.fd, total_nbytes)


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
