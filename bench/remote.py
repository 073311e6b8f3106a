"""The remote tier (`kvd start --remote`), side by side with what it stands on, in one run.

* **Fetch**: a prompt of 256 blocks of 64 KiB (16 MiB) prefilled on daemon A is written behind to
  a redis-server on loopback TCP; daemon B then opens it and gets all 256 blocks as remote hits:
  the time of that `open_sequence` (deferral, one MGET by the tier's fetch thread, header and
  CRC-32 checks, copies into B's segment, seals, journal commit, reply) against raw redis-py
  (hiredis) pipelined `MGET`s of the same 256 values, in the same rounds, the two taking turns at
  going first. Goal: kvd >= 0.8x the raw MGETs' throughput.
* **Local lookup p99**: a 16-block lookup that hits locally, on four daemons served in turn:
  no tier, tier healthy, tier down (nothing listens on its port), tier slow (its redis-server
  kept busy with `DEBUG SLEEP 0.2`). Meanwhile another process seals 4 fresh blocks on each
  daemon every 2 ms, so the tiers' write-behind threads work (or fail, or stall) beside the
  loop they must not slow. Goal: each p99 <= 1.2x the no-tier p99.
* **Write-behind CPU**: what the write thread spends per block, beside the loop it shares the
  GIL with: one server's MSET packed in C and in Python, and a pipeline of SETs.

    python -m bench.remote [--quick] [--out DIR]
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

import multiprocessing

import numpy as np

import kvd
from bench.common import (Daemon, GeometryFlags, ServerProcess, bench_main, digests, geometry_of,
                          markdown_table, percentiles, progress, report)
from bench.data_plane import RedisServer, redis_missing

FETCH_GEOMETRY: GeometryFlags = {"layers": 8, "kv_heads": 2, "head_dim": 64, "block_size": 16,
                                 "dtype": "float16"}  # 64 KiB blocks
FETCH_BLOCKS = 256
LOOKUP_BLOCKS = 16
RAW_CHUNK = 32  # keys per MGET of the raw fetch (the tier's FETCH_CHUNK)


class TcpRedis(RedisServer):
    """redis-server on a free loopback TCP port (the tier speaks TCP), no persistence."""

    def __init__(self) -> None:
        import redis

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        directory = tempfile.mkdtemp(prefix="kvdr-", dir="/tmp")
        self.client = redis.Redis(port=self.port)
        # (RedisServer's __init__ starts one on a Unix socket: its parent's, with a TCP port)
        ServerProcess.__init__(self, ["redis-server", "--port", str(self.port), "--bind",
                                      "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
                                      directory, "--enable-debug-command", "local"],
                               directory, self._answers)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


class _RemoteFlags(TypedDict, total=False):
    """`kvd start`'s remote-tier flags as `Daemon`'s keyword arguments."""
    remote: str
    remote_timeout_ms: int


def _daemon(num_blocks: int, geometry: GeometryFlags, remote: str | None = None,
            timeout_ms: int = 5000) -> Daemon:
    extra: _RemoteFlags = ({} if remote is None
                           else {"remote": remote, "remote_timeout_ms": timeout_ms})
    return Daemon(num_blocks, journal=True, **geometry, **extra)


def _wait(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.005)


# ---- fetch ---------------------------------------------------------------------------------
def raw_mget(client: Any, names: list[str], nbytes: int) -> None:
    """redis-py (hiredis) at its best: pipelined MGETs of RAW_CHUNK keys (one MGET of all 256
    is no faster, and slower to start streaming)."""
    pipe = client.pipeline(transaction=False)
    for start in range(0, len(names), RAW_CHUNK):
        pipe.mget(names[start:start + RAW_CHUNK])
    replies = pipe.execute()
    if sum(len(value) for values in replies for value in values if value) < nbytes:
        raise RuntimeError("raw MGET found fewer bytes than written")


def measure_fetch(rounds: int) -> dict[str, Any]:
    """Per round: A prefills a fresh prompt; raw MGET of its values; B opens it (all remote)."""
    block_size = FETCH_GEOMETRY["block_size"]
    with TcpRedis() as server, _daemon(FETCH_BLOCKS + 16, FETCH_GEOMETRY, server.url) as a_d, \
            _daemon(FETCH_BLOCKS + 16, FETCH_GEOMETRY, server.url) as b_d, \
            a_d.connect() as a, b_d.connect() as b:
        prefix = a.stats()["remote"]["key_prefix"]
        nbytes = FETCH_BLOCKS * a.geometry.block_nbytes
        raw_s, kvd_s = [], []
        for number in range(rounds):
            tokens = [number * 10_000_000 + i for i in range(FETCH_BLOCKS * block_size)] + [1]
            seq = a.open_sequence(tokens)
            for index, block_id in enumerate(seq.block_ids[:FETCH_BLOCKS]):
                a.view(block_id).fill(index + number)
            a.commit_sequence(seq, FETCH_BLOCKS * block_size)
            a.close_sequence(seq)
            _wait(lambda: a.stats()["remote"]["written"] >= FETCH_BLOCKS * (number + 1)
                  and a.stats()["remote"]["queue_depth"] == 0)
            names = [prefix + h.hex() for h in kvd.hash_blocks(tokens, block_size)]
            # the first read of freshly written values is the slower one (redis-server's side):
            # raw and kvd take turns going first, so that it falls on both alike
            for path in (("raw", "kvd") if number % 2 == 0 else ("kvd", "raw")):
                started = time.perf_counter()
                if path == "raw":
                    raw_mget(server.client, names, nbytes)
                    raw_s.append(time.perf_counter() - started)
                    continue
                opened = b.open_sequence(tokens)
                kvd_s.append(time.perf_counter() - started)
                if opened.num_remote_tokens != FETCH_BLOCKS * block_size:
                    raise RuntimeError(f"B got {opened.num_remote_tokens} remote tokens: "
                                       f"{b.stats()['remote']}")
                if not np.all(b.view(opened.block_ids[7]) == 7 + number):
                    raise RuntimeError("B's fetched block 7 holds the wrong bytes")
                b.close_sequence(opened)
            progress(f"fetch round {number + 1}/{rounds}: raw {raw_s[-1] * 1e3:.1f} ms, "
                     f"kvd {kvd_s[-1] * 1e3:.1f} ms")
    raw, through_kvd = statistics.median(raw_s), statistics.median(kvd_s)
    return {"blocks": FETCH_BLOCKS, "block_nbytes": nbytes // FETCH_BLOCKS, "rounds": rounds,
            "raw_mget_ms": [round(x * 1e3, 2) for x in raw_s],
            "kvd_open_ms": [round(x * 1e3, 2) for x in kvd_s],
            "raw_mib_s": round(nbytes / raw / 2**20, 1),
            "kvd_mib_s": round(nbytes / through_kvd / 2**20, 1),
            # each round's raw MGET and kvd fetch run back to back: the median of their ratios
            # is what a burst of noise on a shared machine disturbs least
            "ratio": round(statistics.median(r / k for r, k in zip(raw_s, kvd_s)), 3)}


# ---- local lookups ---------------------------------------------------------------------------
def _prefilled(client: kvd.Client) -> list[bytes]:
    keys = digests(1, LOOKUP_BLOCKS)
    block_ids = client.alloc(LOOKUP_BLOCKS)
    client.seal(block_ids, keys)
    client.release(block_ids)
    return keys


def _lookups(clients: dict[str, kvd.Client], keys: dict[str, list[bytes]], count: int,
             samples: dict[str, list[int]]) -> None:
    """`count` lookups on each daemon, taking turns lookup by lookup (so that a burst of noise
    on this shared machine falls on all of them alike)."""
    clock = time.perf_counter_ns
    turns = [(samples[label], client.lookup, client.release, keys[label])
             for label, client in clients.items()]
    for _ in range(count):
        for timings, lookup, release, hashes in turns:
            started = clock()
            block_ids = lookup(hashes)
            timings.append(clock() - started)
            release(block_ids)


def _keep_sleeping(server: TcpRedis, stop: threading.Event) -> None:
    import redis

    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        while not stop.is_set():
            client.execute_command("DEBUG", "SLEEP", "0.2")
    finally:
        client.close()


def _keep_sealing(socket_paths: list[str], ready: Any, stop: Any) -> None:
    """Another process: 4 fresh blocks sealed and released on each daemon every 2 ms."""
    clients = [kvd.connect(path, reconnect_timeout_s=0) for path in socket_paths]
    start = 1 << 40
    ready.set()
    while not stop.is_set():
        for client in clients:
            block_ids = client.alloc(4)
            client.seal(block_ids, digests(start, 4))
            client.release(block_ids)
        start += 4
        time.sleep(0.002)
    for client in clients:
        client.close()


def measure_lookups(rounds: int, per_round: int) -> dict[str, Any]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # nothing listens there once closed
    geometry: GeometryFlags = {"layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": 16,
                               "dtype": "float16"}
    stop = threading.Event()
    with TcpRedis() as healthy, TcpRedis() as slow:
        sleeper = threading.Thread(target=_keep_sleeping, args=(slow, stop), daemon=True)
        daemons = {"no tier": _daemon(1024, geometry),
                   "tier healthy": _daemon(1024, geometry, healthy.url, 100),
                   "tier down": _daemon(1024, geometry, f"redis://127.0.0.1:{dead_port}", 100),
                   "tier slow": _daemon(1024, geometry, slow.url, 100)}
        try:
            clients = {label: d.connect() for label, d in daemons.items()}
            keys = {label: _prefilled(c) for label, c in clients.items()}
            sleeper.start()
            context = multiprocessing.get_context("spawn")
            sealing, stop_sealing = context.Event(), context.Event()
            sealer = context.Process(target=_keep_sealing, args=(
                [d.socket_path for d in daemons.values()], sealing, stop_sealing))
            sealer.start()
            if not sealing.wait(60):
                raise RuntimeError("the sealing process did not start")
            samples: dict[str, list[int]] = {label: [] for label in daemons}
            for number in range(rounds):
                _lookups(clients, keys, per_round, samples)
                progress(f"lookup round {number + 1}/{rounds}")
            stop_sealing.set()
            sealer.join(30)
            remote = {label: c.stats().get("remote", {}) for label, c in clients.items()}
            for client in clients.values():
                client.close()
        finally:
            stop.set()
            for daemon in daemons.values():
                daemon.stop()
            sleeper.join(5)
    base = percentiles(samples["no tier"])["p99_us"]
    rows = {label: {**percentiles(s), "state": remote[label].get("state", "-"),
                    "written": remote[label].get("written", 0),
                    "dropped": remote[label].get("dropped", 0),
                    "p99_vs_no_tier": round(percentiles(s)["p99_us"] / base, 3)}
            for label, s in samples.items()}
    return {"lookup_blocks": LOOKUP_BLOCKS, "rounds": rounds, "per_round": per_round,
            "daemons": rows}


# ---- the write-behind thread's CPU ------------------------------------------------------------
WRITE_PATHS = ("MSET packed in C", "MSET packed in Python", "pipeline of SETs")


def measure_write_cpu(batches: int) -> dict[str, float]:
    """The write-behind's CPU per block (this thread's time.thread_time), in this process against
    a redis-server, for the lookup bench's 512-byte blocks: one server's MSET packed by kvd's C
    and by its Python twin, and the pipeline of SETs (a cluster's path, and one server's before
    the MSET), taking turns batch by batch."""
    from kvd.server.remote import codec as codec_module
    from kvd.server.remote.codec import BlockCodec, RemoteURL
    from kvd.server.remote.tier import WRITE_BATCH, RemoteTier

    geometry = geometry_of(1024)
    codec = BlockCodec("default", geometry)
    blocks = np.zeros((geometry.num_blocks, geometry.block_nbytes), dtype=np.uint8)
    generations = np.zeros(geometry.num_blocks, dtype=np.uint64)
    with TcpRedis() as server:
        nodes = (("127.0.0.1", server.port),)
        tiers = {path: RemoteTier(RemoteURL(path == WRITE_PATHS[2], nodes), codec)
                 for path in WRITE_PATHS}
        cpu_s = dict.fromkeys(WRITE_PATHS, 0.0)
        saved = codec_module._codec
        try:
            for number in range(batches):
                for path, tier in tiers.items():
                    tier.blocks, tier._generations = blocks, generations
                    tier._writes.extend((i, digest, 0) for i, digest in
                                        enumerate(digests(number * WRITE_BATCH, WRITE_BATCH)))
                    codec_module._codec = None if path == WRITE_PATHS[1] else saved
                    started = time.thread_time()
                    tier._write_batch(server.client)  # (redis-py runs a cluster's SETs alike)
                    cpu_s[path] += time.thread_time() - started
        finally:
            codec_module._codec = saved
        if any(tier.counters["written"] != batches * WRITE_BATCH for tier in tiers.values()):
            raise RuntimeError(f"not all written: {[t.counters for t in tiers.values()]}")
    return {path: round(seconds / (batches * WRITE_BATCH) * 1e6, 2)
            for path, seconds in cpu_s.items()}


# ---- report ----------------------------------------------------------------------------------
def markdown(results: dict[str, Any]) -> str:
    fetch, lookups = results["fetch"], results["lookups"]
    text = (f"## Remote tier (`python -m bench.remote`)\n\n"
            f"Fetch of {fetch['blocks']} blocks of {fetch['block_nbytes'] // 1024} KiB from a "
            f"redis-server on loopback TCP, median of {fetch['rounds']} rounds:\n\n")
    text += markdown_table(
        ["path", "MiB/s", "ms per fetch"],
        [["raw redis-py pipelined MGETs (hiredis)", fetch["raw_mib_s"],
          round(statistics.median(fetch["raw_mget_ms"]), 2)],
         ["kvd open_sequence, all remote hits", fetch["kvd_mib_s"],
          round(statistics.median(fetch["kvd_open_ms"]), 2)],
         ["kvd / raw throughput, median of the rounds' ratios (goal >= 0.8)", fetch["ratio"],
          ""]])
    text += ("\nThe write-behind thread's CPU per 512-byte block (time.thread_time, batches of 32, "
             "the three taking turns):\n\n")
    text += markdown_table(["write path", "us per block"],
                           [[path, us] for path, us in results["write_cpu_us"].items()])
    text += (f"\nLocal lookup of {lookups['lookup_blocks']} cached blocks, "
             f"{lookups['rounds'] * lookups['per_round']} per daemon, the daemons taking turns "
             f"lookup by lookup:\n\n")
    text += markdown_table(
        ["daemon", "tier state at the end", "blocks written / dropped", "p50 us", "p99 us",
         "p99 / no tier (goal <= 1.2)"],
        [[label, row["state"], f"{row['written']} / {row['dropped']}", round(row["p50_us"], 1),
          round(row["p99_us"], 1), row["p99_vs_no_tier"]]
         for label, row in lookups["daemons"].items()])
    return text


def run_bench(quick: bool, out: Path) -> str:
    missing = redis_missing()
    if missing:
        return f"## Remote tier\n\nskipped: {missing}\n"
    progress("remote: fetch through kvd vs raw MGET")
    fetch = measure_fetch(2 if quick else 12)
    progress("remote: local lookup p99 with the tier healthy, down, slow")
    progress("remote: the write-behind thread's CPU per block")
    write_cpu = measure_write_cpu(20 if quick else 400)
    lookups = measure_lookups(2 if quick else 6, 300 if quick else 3000)
    return report(out, "remote", {"fetch": fetch, "write_cpu_us": write_cpu, "lookups": lookups},
                  markdown)


def main(argv: list[str] | None = None) -> int:
    return bench_main(__doc__ or "", run_bench, argv)


if __name__ == "__main__":
    raise SystemExit(main())
