"""kvd/_copy.c's row scatter against NumPy's `dst[rows] = src`, which is its specification.

As with kvd/protocol/_checks.c, the contract is one-sided: where `_copy.scatter_rows` returns True, dst holds
exactly what the NumPy assignment would have written (ordinary and streaming stores alike, any
alignment); where it returns False, dst is untouched and kvd/blockcopy.py runs NumPy. So the tests
check both halves, and that C does answer for the writes PagedKV makes.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import blockcopy

copy = blockcopy._built_copy
needs_copy = pytest.mark.skipif(copy is None, reason="kvd/_copy.c is not built here (a plain "
                                "source checkout or no C compiler): only NumPy runs")


def test_the_c_module_is_built_where_ci_requires_it() -> None:
    """.ci/run sets KVD_REQUIRE_C=1: an install that silently fell back to NumPy fails there."""
    if copy is None and os.environ.get("KVD_REQUIRE_C") != "1":
        pytest.skip("kvd/_copy.c is not built here and KVD_REQUIRE_C is not set")
    assert copy is not None, "KVD_REQUIRE_C=1 but kvd/_copy.c was not built (see pip's output)"
    if os.environ.get("KVD_PURE_PYTHON") != "1":
        assert blockcopy._copy is copy


def placed(shape: tuple[int, int], dtype: np.dtype, offset: int,
           rng: np.random.Generator) -> np.ndarray:
    """A random C-contiguous array starting `offset` bytes past a 64-byte boundary."""
    nbytes = shape[0] * shape[1] * dtype.itemsize
    raw = np.empty(nbytes + 128, dtype=np.uint8)
    start = -raw.ctypes.data % 64 + offset
    array = raw[start:start + nbytes].view(dtype).reshape(shape)
    array[...] = rng.integers(0, 100, size=shape).astype(dtype)
    return array


@needs_copy
@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from([np.uint8, np.float16, np.float32, np.int64]),
       width=st.integers(1, 300), num_dst_rows=st.integers(1, 40), data=st.data(),
       dst_offset=st.sampled_from([0, 8, 16, 48]), src_offset=st.sampled_from([0, 4, 16]),
       streaming=st.booleans())
def test_c_writes_what_numpy_writes(dtype: type, width: int, num_dst_rows: int, data: st.DataObject,
                                    dst_offset: int, src_offset: int, streaming: bool) -> None:
    dtype = np.dtype(dtype)
    dst_offset -= dst_offset % dtype.itemsize  # NumPy needs its items aligned to view them
    src_offset -= src_offset % dtype.itemsize
    rows = np.array(data.draw(st.lists(st.integers(0, num_dst_rows - 1), max_size=60)),
                    dtype=np.int64)  # duplicates too: the last write wins in both
    rng = np.random.default_rng(len(rows) * 1000 + width)
    dst = placed((num_dst_rows, width), dtype, dst_offset, rng)
    src = placed((len(rows), width), dtype, src_offset, rng)
    expected = dst.copy()
    expected[rows] = src
    assert copy.scatter_rows(dst, rows, src, dst.strides[0], streaming) is True
    np.testing.assert_array_equal(dst, expected)


@needs_copy
def test_streaming_writes_a_pagedkv_sized_scatter() -> None:
    """What PagedKV sends: 32 KiB runs to shuffled rows of a page-aligned pool, streamed."""
    rng = np.random.default_rng(1)
    dst = placed((256, 16384), np.dtype(np.float16), 0, rng)
    src = placed((100, 16384), np.dtype(np.float16), 16, rng)
    rows = rng.permutation(256)[:100].astype(np.int64)
    expected = dst.copy()
    expected[rows] = src
    assert copy.scatter_rows(dst, rows, src, dst.strides[0], True) is True
    np.testing.assert_array_equal(dst, expected)


def _refusals(rng: np.random.Generator) -> list[tuple[str, np.ndarray, object, object, int]]:
    dst = placed((8, 16), np.dtype(np.float32), 0, rng)
    src = placed((2, 16), np.dtype(np.float32), 0, rng)
    row_nbytes = dst.strides[0]
    good = np.array([1, 5], dtype=np.int64)
    inside = dst.view(np.uint8).reshape(-1)[:16].view(np.int64)  # rows read from dst itself
    inside[:] = 0
    return [
        ("negative row", dst, np.array([1, -1], dtype=np.int64), src, row_nbytes),
        ("row past the end", dst, np.array([1, 8], dtype=np.int64), src, row_nbytes),
        ("int32 rows", dst, good.astype(np.int32), src, row_nbytes),
        ("float rows", dst, good.astype(np.float64), src, row_nbytes),
        ("big-endian rows", dst, good.astype(">i8"), src, row_nbytes),
        ("src is a view of dst", dst, good, dst[3:5], row_nbytes),
        ("rows are a view of dst", dst, inside, src, row_nbytes),
        ("src too short", dst, good, src[:1], row_nbytes),
        ("src too long", dst, good[:1], src, row_nbytes),
        ("row size zero", dst, good, src, 0),
        ("row size negative", dst, good, src, -64),
        ("dst not whole rows", dst, good, src, 3 * row_nbytes),
        ("dst not contiguous", dst[:, ::2], good, src[:, ::2].copy(), row_nbytes // 2),
        ("src not contiguous", dst, good, np.repeat(src, 2, axis=1)[:, ::2], row_nbytes),
        ("dst read-only", np.frombuffer(dst.tobytes(), dtype=np.float32).reshape(8, 16), good,
         src, row_nbytes),
        ("not buffers", dst, [1, 5], src, row_nbytes),
    ]


@needs_copy
@pytest.mark.parametrize("case", range(16))
def test_c_declines_without_writing_a_byte(case: int) -> None:
    rng = np.random.default_rng(case)
    name, dst, rows, src, row_nbytes = _refusals(rng)[case]
    before = dst.copy()
    for streaming in (False, True):
        assert copy.scatter_rows(dst, rows, src, row_nbytes, streaming) is False, name
        np.testing.assert_array_equal(dst, before)


@needs_copy
def test_rows_changed_by_another_thread_during_a_copy_move_nothing() -> None:
    """Large copies release the GIL. Another thread scribbling out-of-range indices into `rows`
    meanwhile must not redirect the copy: it goes where the check said (or, had the C read
    `rows` again, it would write outside dst, and ASan or the kernel would say so)."""
    rng = np.random.default_rng(3)
    dst = placed((64, 16384), np.dtype(np.uint8), 0, rng)  # 16 KiB rows, 1 MiB in all
    src = placed((16, 16384), np.dtype(np.uint8), 0, rng)
    good = rng.permutation(64)[:16].astype(np.int64)
    rows = good.copy()
    stop = threading.Event()

    def scribble() -> None:
        while not stop.is_set():
            rows[:] = 1 << 40
            rows[:] = good

    scribbler = threading.Thread(target=scribble)
    scribbler.start()
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            accepted = copy.scatter_rows(dst, rows, src, dst.strides[0], True)
            if accepted:  # checked while rows held good: so it wrote there
                np.testing.assert_array_equal(dst[good], src)
    finally:
        stop.set()
        scribbler.join()


@needs_copy
def test_bad_calls_raise() -> None:
    dst = np.zeros((2, 4), dtype=np.float32)
    with pytest.raises(TypeError):
        copy.scatter_rows(dst, np.zeros(1, dtype=np.int64), dst[:1])
    with pytest.raises(TypeError):
        copy.scatter_rows(dst, np.zeros(1, dtype=np.int64), dst[:1].copy(), "16", False)


@pytest.mark.parametrize("streaming", [False, True])
def test_scatter_rows_is_numpys_assignment_whatever_runs(streaming: bool) -> None:
    """The wrapper: C for what it takes, NumPy (its results and errors) for the rest."""
    rng = np.random.default_rng(2)
    for rows in ([3, 0, 3], [-1, 2], []):  # duplicates; a negative index NumPy wraps; nothing
        dst = rng.standard_normal((5, 6)).astype(np.float32)
        src = rng.standard_normal((len(rows), 6)).astype(np.float32)
        expected = dst.copy()
        expected[np.array(rows, dtype=np.int64)] = src
        blockcopy.scatter_rows(dst, np.array(rows, dtype=np.int64), src, streaming)
        np.testing.assert_array_equal(dst, expected)
    dst = np.zeros((5, 6), dtype=np.float32)
    with pytest.raises(IndexError):
        blockcopy.scatter_rows(dst, np.array([5], dtype=np.int64), np.ones((1, 6), np.float32),
                               streaming)
    assert not dst.any()
    overlapping = np.arange(30, dtype=np.float32).reshape(5, 6)
    expected = overlapping.copy()
    expected[np.array([0, 1])] = expected[3:5].copy()
    blockcopy.scatter_rows(overlapping, np.array([0, 1], dtype=np.int64), overlapping[3:5],
                           streaming)
    np.testing.assert_array_equal(overlapping, expected)


def _cache_dir(tmp_path: Path, levels: list[tuple[str, str]]) -> Path:
    for i, (kind, size) in enumerate(levels):
        index = tmp_path / f"index{i}"
        index.mkdir()
        (index / "type").write_text(kind + "\n")
        (index / "size").write_text(size + "\n")
    return tmp_path


def test_last_level_cache_is_the_largest_data_cache(tmp_path: Path) -> None:
    cpu_dir = _cache_dir(tmp_path, [("Data", "32K"), ("Instruction", "64M"), ("Unified", "1024K"),
                                    ("Unified", "32768K")])
    assert blockcopy.last_level_cache_nbytes(cpu_dir) == 32 << 20


def test_last_level_cache_falls_back_when_sysfs_says_nothing(tmp_path: Path) -> None:
    assert blockcopy.last_level_cache_nbytes(tmp_path / "absent") == blockcopy.FALLBACK_LLC_NBYTES
    cpu_dir = _cache_dir(tmp_path, [("Unified", "lots"), ("Data", "")])
    assert blockcopy.last_level_cache_nbytes(cpu_dir) == blockcopy.FALLBACK_LLC_NBYTES
    assert blockcopy.STREAMING_MIN_NBYTES == blockcopy.last_level_cache_nbytes() // 4


@pytest.mark.parametrize("shape,dtype", [((0,), np.float32), ((3, 5), np.uint16),
                                         ((2, 7, 4096), np.float16), ((1, 1), np.float64)])
def test_page_aligned_empty(shape: tuple[int, ...], dtype: type) -> None:
    for _ in range(4):  # np.empty's own placement varies with the size and the heap
        array = blockcopy.page_aligned_empty(shape, dtype)
        assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous
        assert array.size == 0 or array.ctypes.data % mmap.PAGESIZE == 0  # (no bytes to place)
        array[...] = 1  # writable, and all of it is there
