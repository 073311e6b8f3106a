"""Data plane: one layer's K/V for a 4k-token sequence, from kvd's shared memory vs the alternatives.

A worker reading its KV cache gathers, for one layer, the blocks of its block table:
`pool[block_ids, layer]` -> `(num_blocks, 2, block_size, H, D)`, exactly what
workers/model.py's PagedKV does. Measured in one run, best of many repeats (the stores take turns
call by call):

* **kvd**: the gather (and the scatter write) through `client.pool`, a NumPy view of the daemon's
  POSIX shared-memory segment, with block ids a real `alloc` handed out (shuffled: a long-lived
  pool hands out scattered blocks);
* **private**: the same fancy-index gather from a private NumPy array of the same shape — the
  ceiling (goal: kvd >= 0.9x its throughput, i.e. shared memory costs nothing); also a private
  array on 4 KiB pages, because NumPy gets transparent huge pages for its arrays and a tmpfs
  segment usually does not (shmem_enabled=never): the write gap is the page size;
* **Redis**: what a user might pick instead, `redis-server` on a Unix socket (started here, no
  persistence), one key per (block, layer) holding its bytes, MGET to gather (plus the
  `np.frombuffer` of the joined values) and MSET to write. Skipped with a message when
  redis-server or redis-py is missing (`apt-get install -y redis-server`, `pip install redis`).
  Expectation: kvd >= 10x Redis.

    python -m bench.data_plane [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    ROOT,
    Daemon,
    best_seconds,
    markdown_table,
    progress,
    pyplot,
    save_plot,
    write_json,
)

GEOMETRY = {"layers": 4, "kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "float16"}
GOAL_PRIVATE_RATIO = 0.9
EXPECTED_REDIS_SPEEDUP = 10.0


def gather(pool: np.ndarray, block_ids: np.ndarray, layer: int) -> np.ndarray:
    """One layer's K and V of a sequence: `(num_blocks, 2, block_size, H, D)`, a copy."""
    return pool[block_ids, layer]


def scatter(pool: np.ndarray, block_ids: np.ndarray, layer: int, kv: np.ndarray) -> None:
    """Write one layer's K and V of a sequence into its blocks."""
    pool[block_ids, layer] = kv


def time_numpy(stores: dict[str, np.ndarray], block_ids: np.ndarray, kv: np.ndarray,
               repeats: int) -> dict[str, dict[str, float]]:
    """Best seconds of a gather and of a scatter of layer 1 (any layer costs the same) per store,
    the stores taking turns call by call so that machine noise hits them alike."""
    best = {name: {"read_s": float("inf"), "write_s": float("inf")} for name in stores}
    for _ in range(repeats):
        for name, pool in stores.items():
            for what, func in (("read_s", lambda pool=pool: gather(pool, block_ids, 1)),
                               ("write_s", lambda pool=pool: scatter(pool, block_ids, 1, kv))):
                best[name][what] = min(best[name][what], best_seconds(func, 1))
    return best


# ---- Redis ------------------------------------------------------------------------------------
def redis_missing() -> str | None:
    """Why the Redis comparison cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install -y redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (pip install redis)"
    return None


class RedisServer:
    """redis-server on a Unix socket in a temp dir, no persistence; a context manager."""

    def __init__(self) -> None:
        import redis

        self.directory = tempfile.mkdtemp(prefix="kvdr-", dir="/tmp")
        self.socket_path = os.path.join(self.directory, "redis.sock")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", self.socket_path,
             "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
             "--dir", self.directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(unix_socket_path=self.socket_path)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def time_redis(kv: np.ndarray, repeats: int) -> dict[str, float]:
    """MSET the blocks' bytes (one key per block of one layer), MGET them back into an array."""
    keys = [f"kv:{i}:1".encode() for i in range(len(kv))]

    def write() -> None:
        server.client.mset({key: block.tobytes() for key, block in zip(keys, kv)})

    def read() -> np.ndarray:
        return np.frombuffer(b"".join(server.client.mget(keys)), dtype=kv.dtype).reshape(kv.shape)

    with RedisServer() as server:
        write_s = best_seconds(write, repeats)
        read_s = best_seconds(read, repeats)
        if not np.array_equal(read(), kv):
            raise RuntimeError("Redis returned different bytes than were written")
    return {"read_s": read_s, "write_s": write_s}


# ---- driver -------------------------------------------------------------------------------------
def run(quick: bool) -> dict[str, Any]:
    num_tokens = 1024 if quick else 4096
    repeats = 5 if quick else 200  # a gather is ~1 ms: many repeats are cheap, and the best
    # of many is what survives other processes' bursts of memory traffic
    block_size = GEOMETRY["block_size"]
    num_seq_blocks = num_tokens // block_size
    num_blocks = 2 * num_seq_blocks
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"geometry": GEOMETRY, "num_tokens": num_tokens,
                               "num_pool_blocks": num_blocks, "repeats": repeats}
    progress(f"data plane: {num_tokens}-token sequence, {num_blocks}-block pool")
    with Daemon(num_blocks, **GEOMETRY) as daemon, daemon.connect() as client:
        allocated = np.array(client.alloc(num_blocks))
        block_ids = rng.permutation(allocated)[:num_seq_blocks]
        pool = client.pool
        kv = rng.standard_normal(gather(pool, block_ids, 1).shape).astype(pool.dtype)
        pool[:] = 1  # touch every page, as the private copies' are
        private = np.ones_like(pool)
        # NumPy asks for transparent huge pages on large arrays (madvise); shared memory gets
        # 4 KiB pages unless /sys/kernel/mm/transparent_hugepage/shmem_enabled allows more. An
        # anonymous mmap without that advice shows how much of a gap is the page size.
        small_pages = mmap.mmap(-1, pool.nbytes)
        private_4k = np.frombuffer(small_pages, dtype=pool.dtype).reshape(pool.shape)
        private_4k[:] = 1
        results["layer_nbytes"] = kv.nbytes
        results.update(time_numpy({"kvd": pool, "private": private, "private_4k": private_4k},
                                  block_ids, kv, repeats))
        if not np.array_equal(gather(pool, block_ids, 1), kv):
            raise RuntimeError("the shared-memory gather did not return what was written")
        del pool, private, private_4k
        small_pages.close()
    missing = redis_missing()
    if missing is None:
        progress("data plane: Redis MSET/MGET of the same blocks")
        results["redis"] = time_redis(kv, min(repeats, 20))
    else:
        results["redis_skipped"] = missing
        progress(f"data plane: Redis skipped: {missing}")
    return results


def ratios(results: dict[str, Any]) -> dict[str, float]:
    kvd = results["kvd"]
    out = {f"kvd_vs_private_{what}": results["private"][f"{what}_s"] / kvd[f"{what}_s"]
           for what in ("read", "write")}
    if "redis" in results:
        out.update({f"kvd_vs_redis_{what}": results["redis"][f"{what}_s"] / kvd[f"{what}_s"]
                    for what in ("read", "write")})
    return out


def markdown(results: dict[str, Any]) -> str:
    nbytes = results["layer_nbytes"]
    rows = []
    for store in ("kvd", "private", "private_4k", "redis"):
        if store not in results:
            continue
        row = results[store]
        rows.append([{"kvd": "kvd shared memory (client.pool)", "private": "private NumPy array",
                      "private_4k": "private array, 4 KiB pages (anonymous mmap)",
                      "redis": "Redis MGET / MSET (Unix socket)"}[store],
                     f"{row['read_s'] * 1e3:.2f}", f"{nbytes / row['read_s'] / 1e9:.2f}",
                     f"{row['write_s'] * 1e3:.2f}", f"{nbytes / row['write_s'] / 1e9:.2f}"])
    table = markdown_table(["store", "gather ms", "gather GB/s", "write ms", "write GB/s"], rows)
    r = ratios(results)
    small = results["private_4k"]
    notes = (f"kvd / private throughput: gather {r['kvd_vs_private_read']:.2f}x, write "
             f"{r['kvd_vs_private_write']:.2f}x (goal >= {GOAL_PRIVATE_RATIO}x); against a "
             f"private array on 4 KiB pages, as shared memory is here: gather "
             f"{small['read_s'] / results['kvd']['read_s']:.2f}x, write "
             f"{small['write_s'] / results['kvd']['write_s']:.2f}x. ")
    if "redis" in results:
        notes += (f"kvd over Redis: gather {r['kvd_vs_redis_read']:.1f}x, write "
                  f"{r['kvd_vs_redis_write']:.1f}x faster (expected >= {EXPECTED_REDIS_SPEEDUP:.0f}x).")
    else:
        notes += f"Redis skipped: {results['redis_skipped']}."
    return (f"## Data plane: one layer's K/V of a {results['num_tokens']}-token sequence "
            f"({nbytes / 2**20:.0f} MiB, bench/data_plane.py)\n\n" + table + "\n" + notes + "\n")


def plot(results: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    stores = [s for s in ("kvd", "private", "private_4k", "redis") if s in results]
    nbytes = results["layer_nbytes"]
    figure, axes = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for i, what in enumerate(("read", "write")):
        x = [j + i * width for j in range(len(stores))]
        axes.bar(x, [nbytes / results[s][f"{what}_s"] / 1e9 for s in stores], width,
                 label="gather" if what == "read" else "write")
    axes.set(xticks=[j + width / 2 for j in range(len(stores))], xticklabels=stores,
             ylabel="GB/s", title=f"One layer's K/V, {results['num_tokens']} tokens")
    axes.legend()
    return save_plot(figure, out, "data_plane")


def run_bench(quick: bool, out: Path) -> str:
    results = run(quick)
    results["ratios"] = ratios(results)
    write_json(out, "data_plane", results)
    plot(results, out)
    return markdown(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (1k tokens)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    print(run_bench(args.quick, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
