"""Data plane: one layer's K/V for a 4k-token sequence, in kvd's shared memory vs the alternatives.

A worker moves its KV cache one layer at a time: it writes the K and V of its new tokens into the
sequence's blocks, then gathers the K and V of every token back for attention. Both are
workers/model.py's `PagedKV.write` and `PagedKV.gather`, run here unchanged over each store with
the same data (a float16 model's K/V, so no dtype conversion hides the copies). A decode step is
timed too: the newest token's K/V written into its block, then the whole layer read back as
float32 for attention (`PagedKV.read`, which converts only the blocks written since). The stores:

* **kvd**: `PagedKV` over `client.pool`, the NumPy view of the daemon's POSIX shared-memory
  segment, with block ids a real `alloc` handed out (shuffled: a long-lived pool hands out
  scattered blocks);
* **kvd, ordinary stores**: the same pool with the write's streaming stores turned off
  (`streaming_min_nbytes=math.inf`): what they buy (kvd/blockcopy.py); its gather is kvd's again;
* **private**: a private NumPy array of the same shape, starting on a page boundary as kvd's pool
  does: the ceiling (goal: kvd >= 0.9x its throughput);
* **private, 4 KiB pages**: the same on 4 KiB pages (MADV_NOHUGEPAGE), the page size shared
  memory gets on a default (`huge=never`) /dev/shm, where NumPy's private arrays get 2 MiB pages;
* **Redis**: what a user might pick instead: `redis-server` on a Unix socket (started here, no
  persistence), a key per block, layer and part. A write is one pipeline of two MSETs of
  zero-copy memoryviews, a gather one pipeline of two MGETs copied into a buffer reused from call
  to call, as PagedKV does. Replies go through hiredis when installed; commands always through
  redis-py's own packer, which sends large values without copying them. Skipped with a message
  when redis-server or redis-py >= 5 is missing. Expectation: kvd >= 10x Redis.

What makes such copies differ, and how the bench holds it equal: page size (the output states
which pages each store really got); alignment (memmove's speed depends on where source and
destination sit in their 64-byte lines, so every array here starts on a page, as kvd's pool
does); page faults (a process's first touch of a page faults, so every store is touched before
timing and the table lists faults per call); and turn order (an op right after Redis's finds the
caches full of Redis's buffers, so every round runs the ops in a fresh random order and every op
follows every other equally often). Medians over the rounds.

    python -m bench.data_plane [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (Daemon, GeometryFlags, ServerProcess, bench_main, markdown_table,
                          progress, pyplot, report, save_plot)
from kvd.blockcopy import STREAMING_MIN_NBYTES, page_aligned_empty
from workers.model import PagedKV

GEOMETRY: GeometryFlags = {"layers": 4, "kv_heads": 8, "head_dim": 128, "block_size": 16,
                           "dtype": "float16"}
GOAL_PRIVATE_RATIO = 0.9
EXPECTED_REDIS_SPEEDUP = 10.0
LAYER = 1  # any layer costs the same
REDIS_BUFFER_CUTOFF = 6000  # redis-py's own: values longer than this are sent, not copied
STORE_LABELS = {"kvd": "kvd shared memory (client.pool)",
                "kvd_ordinary": "kvd, writes with ordinary stores",
                "private": "private NumPy array",
                "private_4k": "private array, 4 KiB pages",
                "redis": "Redis MGET / MSET (Unix socket)"}


# ---- the private stores ---------------------------------------------------------------------
def small_pages_mapping(nbytes: int) -> mmap.mmap:
    """Private anonymous memory kept on 4 KiB pages."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return mapping


def huge_page_nbytes(array: np.ndarray) -> int | None:
    """How many bytes of `array` this process maps with 2 MiB pages (None if unknown)."""
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    try:
        with open("/proc/self/smaps", encoding="ascii") as file:
            smaps = file.read()
    except OSError:
        return None
    total_kib = 0
    for area in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        low, high = (int(x, 16) for x in area.split(None, 1)[0].split("-"))
        if low < end and high > start:
            total_kib += sum(int(kib) for kib in re.findall(
                r"^(?:AnonHugePages|ShmemPmdMapped):\s+(\d+) kB", area, re.M))
    return total_kib * 1024


def shm_huge_option() -> str:
    """The `huge=` option /dev/shm is mounted with (what decides its page size)."""
    with open("/proc/mounts", encoding="ascii") as file:
        for line in file:
            fields = line.split()
            if fields[1] == "/dev/shm":
                match = re.search(r"huge=(\w+)", fields[3])
                return match.group(1) if match else "never"
    return "unknown"


# ---- Redis ------------------------------------------------------------------------------------
def redis_missing() -> str | None:
    """Why the Redis comparison cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install -y redis-server)"
    try:
        import redis.connection
    except ImportError:
        return "redis-py is not installed (pip install redis hiredis)"
    if not hasattr(redis.connection, "PythonRespSerializer"):
        return "redis-py is older than 5.0 (pip install -U redis)"
    return None


class RedisServer(ServerProcess):
    """redis-server on a Unix socket in a temp dir, no persistence, and a client."""

    def __init__(self) -> None:
        import redis
        from redis.connection import Encoder, PythonRespSerializer

        directory = tempfile.mkdtemp(prefix="kvdr-", dir="/tmp")
        self.socket_path = os.path.join(directory, "redis.sock")
        # With hiredis installed, redis-py also packs commands with it, copying every value
        # into one bytes object; its own packer sends large values (the blocks' memoryviews) as
        # they are, which wrote in half the time here. Replies still go through hiredis.
        encoder = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)
        self.client = redis.Redis(connection_pool=redis.ConnectionPool(
            connection_class=redis.UnixDomainSocketConnection, path=self.socket_path,
            command_packer=PythonRespSerializer(REDIS_BUFFER_CUTOFF, encoder.encode)))
        super().__init__(["redis-server", "--port", "0", "--unixsocket", self.socket_path,
                          "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                          "--dir", directory], directory, self._answers)

    def _answers(self) -> bool:
        import redis

        try:
            return bool(self.client.ping())
        except redis.exceptions.ConnectionError:
            return False

    def stop(self) -> None:
        self.client.close()
        super().stop()


class RedisKV:
    """One layer of a sequence's K/V in Redis, a key per block and part, moved as PagedKV moves
    it: a write is one pipeline of two MSETs (zero-copy memoryviews of the blocks), a gather one
    pipeline of two MGETs copied into a buffer reused from call to call (joining the replies
    into a fresh array instead faulted in 16 MiB of new pages per call)."""

    def __init__(self, client: Any, num_blocks: int, block_shape: tuple[int, ...],
                 dtype: np.dtype) -> None:
        self.client = client
        self.names = {part: [f"kv:{i}:{LAYER}:{part}".encode() for i in range(num_blocks)]
                      for part in ("k", "v")}
        self._gathered = page_aligned_empty((2, num_blocks, math.prod(block_shape)), dtype)
        self._token_shape = block_shape[1:]

    def write(self, keys: np.ndarray, values: np.ndarray) -> None:
        pipe = self.client.pipeline(transaction=False)
        for part, data in (("k", keys), ("v", values)):
            blocks = data.reshape(len(self.names[part]), -1)
            # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
            pipe.mset({name: memoryview(block).cast("B")  # type: ignore[arg-type]
                       for name, block in zip(self.names[part], blocks)})
        pipe.execute()

    def gather(self) -> tuple[np.ndarray, np.ndarray]:
        pipe = self.client.pipeline(transaction=False)
        for part in ("k", "v"):
            pipe.mget(self.names[part])
        for index, blobs in enumerate(pipe.execute()):
            for block, blob in enumerate(blobs):
                self._gathered[index, block] = np.frombuffer(blob, dtype=self._gathered.dtype)
        tokens = self._gathered.reshape(2, -1, *self._token_shape)
        return tokens[0], tokens[1]


def redis_parser() -> str:
    """Which reply parser redis-py uses (hiredis when it is installed)."""
    import redis.utils

    return "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure-Python parser"


# ---- timing -----------------------------------------------------------------------------------
def time_rounds(ops: dict[tuple[str, str], Callable[[], Any]], num_rounds: int,
                rng: np.random.Generator) -> dict[tuple[str, str], dict[str, float]]:
    """Median seconds and minor page faults per call of each op, the ops taking turns.

    Each round runs every op once in a fresh random order, so that every op follows every other
    one equally often (module docstring: turn order).
    """
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in ops}
    faults: dict[tuple[str, str], list[int]] = {key: [] for key in ops}
    order = list(ops)
    for _ in range(num_rounds):
        for index in rng.permutation(len(order)):
            key = order[index]
            op = ops[key]
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            op()
            seconds[key].append(time.perf_counter() - start)
            faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    return {key: {"median_s": float(np.median(seconds[key])),
                  "p10_s": float(np.percentile(seconds[key], 10)),
                  "p90_s": float(np.percentile(seconds[key], 90)),
                  "faults": float(np.median(faults[key]))} for key in ops}


# ---- driver -------------------------------------------------------------------------------------
def run(quick: bool) -> dict[str, Any]:
    num_tokens = 1024 if quick else 4096
    num_rounds = 5 if quick else 100  # a round is ~60 ms, most of it Redis's
    num_seq_blocks = num_tokens // GEOMETRY["block_size"]
    num_blocks = 2 * num_seq_blocks
    results: dict[str, Any] = {"geometry": GEOMETRY, "num_tokens": num_tokens,
                               "num_pool_blocks": num_blocks, "num_rounds": num_rounds,
                               "shm_huge": shm_huge_option()}
    progress(f"data plane: {num_tokens}-token sequence, {num_blocks}-block pool")
    missing = redis_missing()
    if missing is not None:
        progress(f"data plane: Redis skipped: {missing}")
        results["redis_skipped"] = missing
    with Daemon(num_blocks, **GEOMETRY) as daemon, daemon.connect() as client, \
            (RedisServer() if missing is None else contextlib.nullcontext()) as server:
        rng = np.random.default_rng(0)
        table = [int(i) for i in rng.permutation(client.alloc(num_blocks))[:num_seq_blocks]]
        small_pages = small_pages_mapping(client.pool.nbytes)
        results.update(measure(client.pool, small_pages, table, server, num_rounds, rng))
        small_pages.close()  # measure() has returned: no view of it is left
    return {**results, "ratios": ratios(results)}


def measure(pool: np.ndarray, small_pages: mmap.mmap, table: list[int],
            server: RedisServer | None, num_rounds: int,
            rng: np.random.Generator) -> dict[str, Any]:
    """Time PagedKV's write and gather over every store (and Redis's), then check what they
    gathered is what was written."""
    num_tokens = len(table) * pool.shape[3]
    token_shape = (num_tokens, *pool.shape[4:])
    keys = rng.standard_normal(token_shape).astype(pool.dtype)
    values = rng.standard_normal(token_shape).astype(pool.dtype)
    stores = {"kvd": pool, "private": page_aligned_empty(pool.shape, pool.dtype),
              "private_4k": np.frombuffer(small_pages, dtype=pool.dtype).reshape(pool.shape)}
    for store in stores.values():
        store[:] = 1  # every page touched (and faulted in) before timing
    results: dict[str, Any] = {
        "layer_nbytes": keys.nbytes + values.nbytes, "pool_nbytes": pool.nbytes,
        "huge_page_nbytes": {name: huge_page_nbytes(store) for name, store in stores.items()},
        "streaming_min_nbytes": STREAMING_MIN_NBYTES}
    paged = {name: PagedKV(store, table) for name, store in stores.items()}
    # What the streaming stores of a large write buy (kvd/blockcopy.py), side by side.
    paged["kvd_ordinary"] = PagedKV(pool, table, streaming_min_nbytes=math.inf)
    writes = {name: partial(kv.write, LAYER, 0, keys, values) for name, kv in paged.items()}
    gathers: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = {
        name: partial(kv.gather, LAYER, num_tokens) for name, kv in paged.items()}
    if server is not None:
        progress(f"data plane: Redis ({redis_parser()}) taking turns with the others")
        results["redis_parser"] = redis_parser()
        redis_kv = RedisKV(server.client, len(table), pool.shape[3:], pool.dtype)
        writes["redis"] = partial(redis_kv.write, keys, values)
        gathers["redis"] = redis_kv.gather
    # A PagedKV of its own per store for the decode step: the full writes above would otherwise
    # mark its whole copy stale every round (the bytes they write are the same).
    decodes = {name: partial(decode_step, PagedKV(store, table), num_tokens, keys[-1:],
                             values[-1:]) for name, store in stores.items()}
    for op in (*writes.values(), *decodes.values()):  # a gather never first (Redis: no keys)
        op()
    timings = time_rounds({**{(name, "write"): op for name, op in writes.items()},
                           **{(name, "gather"): op for name, op in gathers.items()},
                           **{(name, "decode"): op for name, op in decodes.items()}},
                          num_rounds, rng)
    for (name, what), timing in timings.items():
        results.setdefault(name, {})[what] = timing
    for name, gather in gathers.items():
        got_keys, got_values = gather()
        if not (np.array_equal(got_keys, keys) and np.array_equal(got_values, values)):
            raise RuntimeError(f"{name} gathered different K/V than was written")
    return results


def decode_step(kv: PagedKV, num_tokens: int, key: np.ndarray, value: np.ndarray) -> None:
    """A decode step's K/V traffic for one layer: the newest token's K/V written into its block,
    then every position read back as float32 for attention (`PagedKV.read`, which keeps a float32
    copy of the layer and converts only the blocks written since)."""
    kv.write(LAYER, num_tokens - 1, key, value)
    kv.read(LAYER, num_tokens)


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Throughput of kvd over each other store (> 1: kvd is faster)."""
    kvd = results["kvd"]
    return {f"kvd_vs_{store}_{what}": results[store][what]["median_s"] / kvd[what]["median_s"]
            for store in ("kvd_ordinary", "private", "private_4k", "redis") if store in results
            for what in ("write", "gather")}


def markdown(results: dict[str, Any]) -> str:
    nbytes = results["layer_nbytes"]
    rows = []
    for store in STORE_LABELS:
        if store not in results:
            continue
        row = [STORE_LABELS[store]]
        for what in ("write", "gather"):
            timing = results[store][what]
            row += [f"{timing['median_s'] * 1e3:.2f}",
                    f"{nbytes / timing['median_s'] / 1e9:.1f}", f"{timing['faults']:.0f}"]
        decode = results[store].get("decode")
        rows.append(row + ["—" if decode is None else f"{decode['median_s'] * 1e6:.0f}"])
    table = markdown_table(["store", "write ms", "write GB/s", "write faults", "gather ms",
                            "gather GB/s", "gather faults", "decode step µs"], rows)
    r = ratios(results)
    huge = results["huge_page_nbytes"]
    mib = lambda name: ("?" if huge[name] is None else f"{huge[name] / 2**20:.0f}")
    notes = [
        f"kvd / private throughput: write **{r['kvd_vs_private_write']:.2f}x**, gather "
        f"**{r['kvd_vs_private_gather']:.2f}x** (goal >= {GOAL_PRIVATE_RATIO}x); against the "
        f"private array on 4 KiB pages: write {r['kvd_vs_private_4k_write']:.2f}x, gather "
        f"{r['kvd_vs_private_4k_gather']:.2f}x.",
        f"Large writes use streaming stores (kvd/blockcopy.py, here from "
        f"{results['streaming_min_nbytes'] / 2**20:.0f} MiB): into kvd's pool they wrote "
        f"{r['kvd_vs_kvd_ordinary_write']:.2f}x as fast as ordinary stores (that row's gather "
        f"is kvd's, timed again: the two differ by noise alone).",
        f"Pages: of each store's {results['pool_nbytes'] / 2**20:.0f} MiB, {mib('kvd')} MiB of "
        f"kvd's mapping, {mib('private')} MiB of the private array and {mib('private_4k')} MiB "
        f"of the 4 KiB-page array are on 2 MiB pages (/dev/shm is mounted "
        f"huge={results['shm_huge']}"
        + ("; mounted huge=within_size, it gives the segment 2 MiB pages)."
           if results["shm_huge"] == "never" else ")."),
    ]
    if "redis" in results:
        notes.append(f"kvd over Redis ({results['redis_parser']} replies): write "
                     f"**{r['kvd_vs_redis_write']:.1f}x**, gather "
                     f"**{r['kvd_vs_redis_gather']:.1f}x** faster (expected >= "
                     f"{EXPECTED_REDIS_SPEEDUP:.0f}x).")
    else:
        notes.append(f"Redis skipped: {results['redis_skipped']}.")
    return (f"## Data plane: one layer's K/V of a {results['num_tokens']}-token sequence "
            f"({nbytes / 2**20:.0f} MiB, bench/data_plane.py)\n\n"
            f"`PagedKV.write` and `PagedKV.gather` (workers/model.py) over each store; medians "
            f"of {results['num_rounds']} rounds taken in turn; faults are minor page faults per "
            "call. A decode step writes the newest token's K/V and reads the layer back as "
            "float32 for attention (`PagedKV.read`: only the blocks written since are copied "
            "and converted).\n\n" + table + "\n" + " ".join(notes) + "\n")


def plot(results: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    stores = [s for s in STORE_LABELS if s in results]
    nbytes = results["layer_nbytes"]
    figure, axes = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for i, what in enumerate(("write", "gather")):
        x = [j + i * width for j in range(len(stores))]
        axes.bar(x, [nbytes / results[s][what]["median_s"] / 1e9 for s in stores], width,
                 label=what)
    axes.set(xticks=[j + width / 2 for j in range(len(stores))], xticklabels=stores,
             ylabel="GB/s (median)", title=f"One layer's K/V, {results['num_tokens']} tokens")
    axes.legend()
    return save_plot(figure, out, "data_plane")


def run_bench(quick: bool, out: Path) -> str:
    return report(out, "data_plane", run(quick), markdown, plot)


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
