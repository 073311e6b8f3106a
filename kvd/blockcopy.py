"""Bulk writes of block runs into the pool: `dst[rows] = src`, with streaming stores when large.

Theory of operation
-------------------
A worker writes a layer's K (or V) for many tokens at once, a prefill's worth of block runs (a
block's tokens of one layer's K, say 32 KiB) scattered over the pool. NumPy's fancy assignment
copies them one memcpy per run, and each is far below the size at which glibc would use
non-temporal stores, so a large write goes through the caches: every line is read for ownership
before it is written, and the write evicts the source it is reading. `scatter_rows` does the same
assignment in kvd/_copy.c, and when the caller's whole write is at least `STREAMING_MIN_NBYTES`
(a quarter of the last-level cache, about where glibc 2.38 and later switch a single copy to
non-temporal stores) it writes with streaming stores that go straight to memory.

Measured on a 2-core EPYC VM (1 MiB L2 per core, 32 MiB L3; bench/data_plane.py and a sweep of
scatter sizes, ordinary and streaming stores interleaved): a 16 MiB write took 1.20-1.34 ms
streaming against 1.74-2.01 ms ordinary in the bench (a plain 16 MiB memcpy: 1.75-1.9); writing and
then reading back what was written, as a forward pass does, streaming won from about 5 MiB up (1.2x
at 8-64 MiB) and lost below (0.56-0.8x at 1-3 MiB: the lines an ordinary write leaves in the cache
are the ones read next). Hence the threshold, with room to spare on that machine.

The other half of copying fast is where the destination sits: glibc's memmove copies a run into
a destination 16 bytes past a 64-byte line at about half speed (a 16 MiB gather 2.2 ms against
1.2 ms), and `np.empty` puts large arrays exactly there. kvd's pool starts on a page;
`page_aligned_empty` gives buffers that do too.

Where kvd/_copy.c is not built, or with KVD_PURE_PYTHON=1, or for anything it declines
(negative or out-of-range rows, overlapping buffers, non-contiguous arrays), the NumPy assignment
runs: it is the specification, and raises NumPy's errors.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import numpy as np

from kvd import native

_built_copy = native.built("copy")  # (twin tests call it directly)
_copy = native.load("copy")

FALLBACK_LLC_NBYTES = 32 * 1024 * 1024  # when sysfs does not say


def last_level_cache_nbytes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Size of the largest data or unified cache CPU 0 reports in sysfs (FALLBACK_LLC_NBYTES
    where it reports none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = 0
    for index in cpu_dir.glob("index[0-9]*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if size[:-1].isdigit() and size[-1] in units:
            best = max(best, int(size[:-1]) * units[size[-1]])
        elif size.isdigit():
            best = max(best, int(size))
    return best or FALLBACK_LLC_NBYTES


STREAMING_MIN_NBYTES = last_level_cache_nbytes() // 4


def scatter_rows(dst: np.ndarray, rows: np.ndarray, src: np.ndarray, streaming: bool) -> None:
    """`dst[rows] = src` for a 2-D `dst`, an integer array `rows` and a 2-D `src` of
    `len(rows)` rows as wide as dst's; with streaming stores if `streaming` (pass
    `nbytes >= STREAMING_MIN_NBYTES`, nbytes being the whole write the caller is making)."""
    if (_copy is not None and dst.ndim == 2 and src.ndim == 2 and dst.dtype == src.dtype
            and rows.dtype == np.int64 and src.shape == (len(rows), dst.shape[1])
            and dst.shape[1] > 0
            and _copy.scatter_rows(dst, rows, src, dst.strides[0], streaming)):
        return
    dst[rows] = src


def page_aligned_empty(shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
    """An uninitialised C-contiguous array starting on a page boundary (`np.empty` starts large
    arrays 16 bytes past one, where copies into them run at about half speed)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + mmap.PAGESIZE, dtype=np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE
    return raw[start:start + nbytes].view(dtype).reshape(shape)
