"""Bench: crash recovery of a 1M-block pool, and what the journal costs a seal.

Goals (issue 6, item 6): `kvd start --recover` of a 1,000,000-block pool in <= 2 s, and the
journal costs <= 20 % of seal throughput at batch 16.

Recovery. A child process runs a real `Daemon` in-process, seals every block of the pool under a
fresh 16-byte key (in a random block order, committing the journal every 65,536 seals, as the
daemon's group commit would), keeps replacing cached blocks by new seals until the journal's log
is as long as compaction lets it grow (about 2 records per live block: the worst case), and then
SIGKILLs itself: the segment and an un-checkpointed WAL journal are left exactly as a crash
leaves them. Each repeat then recovers in a fresh child:
  * end-to-end: `Daemon(recover=True).start()` — flock, journal open, stamp check, journal
    load, pool build, restore, generation bump, socket bind — what a restart costs after Python
    is up; the first repeat reads the crash-left WAL, later ones a checkpointed journal;
  * the same steps timed one by one (journal load, pool build, pool restore, generation bump);
  * `cli ready`: `kvd start --recover` from exec to the first successful connect (interpreter
    start and imports included).
Geometry: 1 layer, 1 KV head, head_dim 8, block_size 1, float16 — 32-byte blocks, so the segment
is 32 MiB and only metadata is measured.

Commit cost. In this process, a full pool of 65,536 blocks churned through a Journal (no sockets;
the journal on /dev/shm, where the daemon keeps it by default): CPU and wall time per commit at
batch 1, 16 and 256 in the steady state (every allocation evicts, the log as long as compaction
lets it grow), with SQLite's INSERT in it alone, and of the upkeep after it (Journal.tidy:
compaction steps and WAL checkpoints, which the daemon runs once the replies are out); the mean
wall time of both is what a commit costs amortised, the max the longest stall.
Beside that pool, a second full pool without a journal runs the same alloc → seal → release
rounds, the two taking turns slice by slice: CPU per round with and without the journal, the
journal's share of the metadata work itself (no sockets, scheduler or cold caches, so no
placement moves it), with the seal step and the journal's commit and upkeep shown apart; and,
where kvd/server/_journal.c is built, a third turn of the journaled pool with its records packed in Python
(`journal.use_c(False)`): what the C packer saves, measured side by side.

Seal throughput. Two real daemons side by side, one journaled and one `--no-journal`, in two
scenarios (SEAL_POOL_BLOCKS): a fresh pool that never evicts, and a full one where every
allocation evicts (a warm cache: the journal also commits tombstones and compacts), at batch 1,
16 and 256; each round runs on both in turn (interleaved, first one then the other, so noise
hits both alike):
  * one client: alloc → seal → release; blocks sealed per second of seal calls (the round trip
    the client waits for, commit included) and per second of the whole loop, medians over
    rounds. Every seal is its own group commit: the worst case for the journal;
  * the same one client with itself and both daemons pinned to one CPU: free-running on a small
    VM, a round trip swings 2x with where the scheduler puts client and daemon (one vCPU or
    two, a halted vCPU to wake), in both modes but not alike: over eight runs of one build the
    free-running cost at batch 16 moved between 18% and 31% (rounds) and 34% and 44% (seal
    calls); on one CPU both modes meet the same conditions and the cost is the journal's work
    against everything else a round does;
  * four clients (processes) doing the same at once; blocks sealed per second of the loop, all
    clients together (their seals share group commits);
  * in both, the daemon's CPU time per sealed block (alloc, seal and release included), from
    /proc/PID/schedstat: what a busy machine inflates least. The journal's cost is 1 - journal
    rate / plain rate, and on CPU 1 - plain CPU / journal CPU (the rate a CPU-bound daemon
    would lose).

    python -m bench.recovery [--num-blocks 1000000] [--repeats 3] [--seconds 1.0] [--out DIR]
                             [--parts recovery,commits,seal] [--batch-sizes 1,16,256]
                             [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import one_cpu, printed_section, write_json

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 1,
            "dtype": "float16"}
CLI_GEOMETRY = ["--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--block-size", "1",
                "--dtype", "float16"]
BATCH_SIZES = (1, 16, 256)
PARTS = ("recovery", "commits", "seal")
COMMIT_EVERY = 65_536
OWNER = 1
GOAL_RECOVERY_S = 2.0
GOAL_JOURNAL_COST = 0.20
# The in-process rounds: what each one times, and in how many turns the two pools take them.
ROUND_STEPS = ("seal", "commit", "commit_wall", "tidy", "total_wall", "round")
NUM_SLICES = 10


def progress(message: str) -> None:
    print(f"[bench.recovery {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def digests(start: int, count: int) -> list[bytes]:
    """Distinct 16-byte keys, the size kvd.hash_blocks returns."""
    return [i.to_bytes(16, "little") for i in range(start, start + count)]


def _daemon(name: str, num_blocks: int, recover: bool):
    from kvd.server.daemon import Daemon
    from kvd.geometry import Geometry
    from kvd.runtime import DaemonPaths

    return Daemon(DaemonPaths.for_name(name), Geometry(num_blocks=num_blocks, **GEOMETRY),
                  recover=recover)


# ---- children ------------------------------------------------------------------------------------
def child_fill(name: str, num_blocks: int) -> None:
    """Seal the whole pool through the daemon's pool and journal, then die like a crash."""
    started = time.perf_counter()
    daemon = _daemon(name, num_blocks, recover=False)
    daemon.start()
    pool, journal = daemon.service.pool, daemon.journal
    block_ids = pool.allocate(num_blocks, OWNER)
    random.Random(0).shuffle(block_ids)  # seal order is not block order after real traffic
    for start in range(0, num_blocks, COMMIT_EVERY):
        chunk = block_ids[start:start + COMMIT_EVERY]
        pool.seal(chunk, digests(start, len(chunk)), OWNER)
        journal.commit()
        journal.tidy()
    pool.release(block_ids, OWNER)
    num_churned = churn(pool, journal, first_key=num_blocks)
    journal_nbytes = sum(path.stat().st_size for path in journal.state_dir.iterdir())
    print(json.dumps({"fill_s": time.perf_counter() - started, "num_churned": num_churned,
                      "num_log_records": journal.num_log_records,
                      "journal_nbytes": journal_nbytes}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def churn(pool, journal, first_key: int, num_rounds_compacting: int = 4) -> int:
    """Replace cached blocks by new seals (evicting them) until the journal has compacted its log
    in a few commits: the log is then as long as compaction lets it grow, the longest a recovery
    reads. Returns how many blocks were sealed."""
    num_sealed, batch_size = 0, min(COMMIT_EVERY, pool.num_blocks // 4)
    while num_rounds_compacting:
        num_records = journal.num_log_records
        block_ids = pool.allocate(batch_size, OWNER)
        pool.seal(block_ids, digests(first_key + num_sealed, len(block_ids)), OWNER)
        journal.commit()
        journal.tidy()
        pool.release(block_ids, OWNER)
        num_sealed += len(block_ids)
        # A commit appends a record per seal (and a tombstone per eviction of a block not
        # sealed again): a log grown by less was compacted.
        if journal.num_log_records < num_records + len(block_ids):
            num_rounds_compacting -= 1
    return num_sealed


class Stopwatch:
    """Wall and CPU seconds of named steps (CPU time stays meaningful on a busy machine)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self, step: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.times[f"{step}_s"] = wall - self._wall
        self.times[f"{step}_cpu_s"] = cpu - self._cpu
        self._wall, self._cpu = wall, cpu


def child_recover(name: str, num_blocks: int) -> None:
    """Time a real recovery end to end, then its steps one by one; print JSON."""
    from kvd.server.daemon import _bump_free_generations
    from kvd.server.journal import Journal
    from kvd.core.pool import BlockPool
    from kvd.runtime import DaemonPaths, state_dir
    from kvd.segment import Segment

    daemon = _daemon(name, num_blocks, recover=True)
    watch = Stopwatch()
    daemon.start()
    watch.lap("end_to_end")
    if daemon.num_restored != num_blocks:
        raise SystemExit(f"recovered {daemon.num_restored} blocks, expected {num_blocks}")
    daemon.stop(keep=True)
    daemon.serve_forever()  # returns at once: stopping, keeps segment and journal

    times, watch = watch.times, Stopwatch()
    journal = Journal(state_dir(name))
    rows = journal.load()
    watch.lap("journal_load")
    segment = Segment.attach(DaemonPaths.for_name(name).segment_name)
    watch.lap("segment_attach")
    pool = BlockPool(num_blocks, "default", segment.generations)
    watch.lap("pool_build")
    pool.restore(rows)
    watch.lap("pool_restore")
    _bump_free_generations(pool, segment.generations)
    watch.lap("generation_bump")
    del pool
    segment.close()
    journal.close()
    print(json.dumps({**times, **watch.times}), flush=True)


def run_child(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench.recovery", "--child", *args], cwd=ROOT,
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"child {args} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(lines[-1])


# ---- daemons as a user runs them ------------------------------------------------------------
def start_cli(name: str, num_blocks: int, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvd.cli", "start", "--name", name, "--num-blocks",
               str(num_blocks), *CLI_GEOMETRY, "--log-level", "WARNING", *flags]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL)


def wait_ready(proc: subprocess.Popen, name: str, timeout_s: float = 60.0) -> None:
    import kvd

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon {name} exited {proc.returncode} before it was ready")
        try:
            kvd.connect(name, reconnect_timeout_s=0).close()
            return
        except kvd.DisconnectedError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon {name} not ready in {timeout_s} s") from None
            time.sleep(0.005)


def shutdown(proc: subprocess.Popen, name: str, keep: bool) -> None:
    import kvd

    with kvd.connect(name, reconnect_timeout_s=0) as client:
        client.shutdown(keep=keep)
    proc.wait(60)


def cli_ready_s(name: str, num_blocks: int) -> float:
    started = time.perf_counter()
    proc = start_cli(name, num_blocks, "--recover")
    try:
        wait_ready(proc, name)
        ready_s = time.perf_counter() - started
        shutdown(proc, name, keep=True)
        return ready_s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- recovery -----------------------------------------------------------------------------------
def bench_recovery(num_blocks: int, repeats: int) -> dict:
    from kvd.runtime import DaemonPaths, state_dir

    name = f"bench-recovery-{uuid.uuid4().hex[:8]}"
    try:
        progress(f"sealing {num_blocks:,} blocks, churning until the journal compacts, "
                 "then SIGKILL ...")
        fill = run_child("fill", name, str(num_blocks))
        runs = []
        for repeat in range(repeats):
            progress(f"recovery {repeat + 1}/{repeats} ...")
            row = run_child("recover", name, str(num_blocks))
            row["cli_ready_s"] = cli_ready_s(name, num_blocks)
            runs.append(row)
        return {"num_blocks": num_blocks, "geometry": GEOMETRY, "goal_s": GOAL_RECOVERY_S,
                "fill_s": fill["fill_s"], "num_churned": fill["num_churned"],
                "num_log_records": fill["num_log_records"],
                "journal_nbytes": fill["journal_nbytes"], "runs": runs,
                "best_end_to_end_s": min(r["end_to_end_s"] for r in runs),
                "best_end_to_end_cpu_s": min(r["end_to_end_cpu_s"] for r in runs),
                "load_average": os.getloadavg()}
    finally:
        segment = f"/dev/shm{DaemonPaths.for_name(name).segment_name}"
        if os.path.exists(segment):
            os.unlink(segment)
        shutil.rmtree(state_dir(name), ignore_errors=True)


# ---- seal throughput ------------------------------------------------------------------------
NUM_CLIENTS = 4
# Two scenarios. "fresh": a pool too big to fill during the bench, so no allocation evicts and
# each round trip has one commit (the seal's). "full": sealed full first, so every allocation
# evicts, and its reply waits for a commit of tombstones too (two commits a round trip); small
# enough that the journal's log soon reaches the length where compaction runs: the steady state
# of a warm cache.
SEAL_POOL_BLOCKS = {"fresh": 1 << 21, "full": 1 << 16}


def seal_round(client, batch_size: int, seconds: float, next_key: list[int],
               num_rounds: int = 0) -> tuple[int, float]:
    """alloc → seal → release until `seconds` passed and `num_rounds` were made: (blocks
    sealed, seconds spent in seals)."""
    clock = time.perf_counter
    seal_s, num_sealed = 0.0, 0
    deadline = clock() + seconds
    while clock() < deadline or num_sealed < num_rounds * batch_size:
        block_ids = client.alloc(batch_size)
        keys = digests(next_key[0], batch_size)
        next_key[0] += batch_size
        t0 = clock()
        client.seal(block_ids, keys)
        seal_s += clock() - t0
        num_sealed += batch_size
        client.release(block_ids)
    return num_sealed, seal_s


def seal_worker(index: int, names: dict[str, str], conn) -> None:
    """One of the concurrent clients: runs the rounds the parent sends, answers their counts."""
    import kvd

    clients = {mode: kvd.connect(name) for mode, name in names.items()}
    next_key = [(index + 1) << 48]  # keys distinct from every other client's
    try:
        while (job := conn.recv()) is not None:
            mode, batch_size, seconds = job
            conn.send(seal_round(clients[mode], batch_size, seconds, next_key)[0])
    finally:
        for client in clients.values():
            client.close()


def process_cpu_s(pid: int) -> float:
    """CPU seconds every live thread of process `pid` has run so far, to the nanosecond
    (/proc/PID/stat's ticks are 10 ms: too coarse for a 0.2 s round; /proc/PID/schedstat
    counts the main thread only, and a daemon with --metrics-port serves them from another)."""
    total_ns = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as file:
                total_ns += int(file.read().split()[0])
        except FileNotFoundError:
            pass  # the thread ended meanwhile
    return total_ns / 1e9


class SealBench:
    """The journaled and the plain daemon, one client of each here and NUM_CLIENTS workers."""

    def __init__(self, names: dict[str, str], procs: dict[str, subprocess.Popen]) -> None:
        import multiprocessing

        import kvd

        self.names, self.procs = names, procs
        self.clients = {mode: kvd.connect(name) for mode, name in names.items()}
        context = multiprocessing.get_context("spawn")  # no inherited sockets
        self.pipes, self.workers = [], []
        for index in range(NUM_CLIENTS):
            here, there = context.Pipe()
            worker = context.Process(target=seal_worker, args=(index, names, there), daemon=True)
            worker.start()
            self.pipes.append(here)
            self.workers.append(worker)

    def one_client(self, mode: str, batch_size: int, seconds: float,
                   next_key: list[int]) -> dict[str, float]:
        cpu, started = process_cpu_s(self.procs[mode].pid), time.perf_counter()
        num_sealed, seal_s = seal_round(self.clients[mode], batch_size, seconds, next_key)
        return {"seal_call_blocks_per_s": num_sealed / seal_s,
                "blocks_per_s": num_sealed / (time.perf_counter() - started),
                "cpu_us_per_block": (process_cpu_s(self.procs[mode].pid) - cpu) / num_sealed * 1e6}

    def many_clients(self, mode: str, batch_size: int, seconds: float) -> dict[str, float]:
        cpu, started = process_cpu_s(self.procs[mode].pid), time.perf_counter()
        for pipe in self.pipes:
            pipe.send((mode, batch_size, seconds))
        num_sealed = sum(pipe.recv() for pipe in self.pipes)
        return {"blocks_per_s": num_sealed / (time.perf_counter() - started),
                "cpu_us_per_block": (process_cpu_s(self.procs[mode].pid) - cpu) / num_sealed * 1e6}

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for worker in self.workers:
            worker.join(30)
        for client in self.clients.values():
            client.close()


def summarise(samples: dict[str, list[dict[str, float]]]) -> dict:
    """Per metric: the median of each mode and the journal's cost (for a rate, 1 - journal /
    plain; for CPU per block, 1 - plain / journal: the rate a CPU-bound daemon loses)."""
    row: dict = {"rounds": samples}
    for metric in samples["journal"][0]:
        journal, plain = (statistics.median(sample[metric] for sample in samples[mode])
                          for mode in ("journal", "no_journal"))
        cost = 1 - plain / journal if metric.startswith("cpu") else 1 - journal / plain
        row[metric] = {"journal": journal, "no_journal": plain, "journal_cost": cost}
    return row


def bench_seal_throughput(seconds: float, batch_sizes: tuple[int, ...] = BATCH_SIZES,
                          num_rounds: int = 10) -> dict:
    """Both scenarios (SEAL_POOL_BLOCKS), each with a fresh pair of daemons."""
    return {"goal_cost_at_16": GOAL_JOURNAL_COST,
            "scenarios": {scenario: bench_seal_scenario(scenario, seconds, batch_sizes,
                                                        num_rounds)
                          for scenario in SEAL_POOL_BLOCKS}}


def bench_seal_scenario(scenario: str, seconds: float, batch_sizes: tuple[int, ...],
                        num_rounds: int) -> dict:
    num_blocks = SEAL_POOL_BLOCKS[scenario]
    os.sync()  # the writeback of what ran before (a 1M-block journal) must not slow this one's
    names = {"journal": f"bench-seal-j-{uuid.uuid4().hex[:8]}",
             "no_journal": f"bench-seal-n-{uuid.uuid4().hex[:8]}"}
    procs = {mode: start_cli(name, num_blocks, *(["--no-journal"] if mode == "no_journal"
                                                  else []))
             for mode, name in names.items()}
    bench = None
    try:
        for mode, name in names.items():
            wait_ready(procs[mode], name)
        bench = SealBench(names, procs)
        if scenario == "full":
            for client in bench.clients.values():
                seal_round(client, 4096, 0.0, [1 << 60], num_rounds=num_blocks // 4096)
        rows: dict[str, dict] = {"1_client": {}, "1_client_one_cpu": {},
                                 f"{NUM_CLIENTS}_clients": {}}
        pinned = (os.getpid(), *(proc.pid for proc in procs.values()))
        for batch_size in batch_sizes:
            progress(f"seal throughput, {scenario} pool, batch {batch_size} ...")
            one: dict[str, list] = {mode: [] for mode in names}
            one_cpu_rounds: dict[str, list] = {mode: [] for mode in names}
            many: dict[str, list] = {mode: [] for mode in names}
            next_key = [0]
            for round_index in range(num_rounds):
                # Interleaved, first one then the other: noise hits both modes alike.
                for mode in list(names)[::1 if round_index % 2 else -1]:
                    one[mode].append(bench.one_client(mode, batch_size, seconds / num_rounds,
                                                      next_key))
                    with one_cpu(*pinned):
                        one_cpu_rounds[mode].append(
                            bench.one_client(mode, batch_size, seconds / num_rounds, next_key))
                    many[mode].append(bench.many_clients(mode, batch_size, seconds / num_rounds))
            rows["1_client"][str(batch_size)] = summarise(one)
            rows["1_client_one_cpu"][str(batch_size)] = summarise(one_cpu_rounds)
            rows[f"{NUM_CLIENTS}_clients"][str(batch_size)] = summarise(many)
        return {"num_blocks": num_blocks, "clients": rows, "load_average": os.getloadavg()}
    finally:
        if bench is not None:
            bench.close()
        for mode, proc in procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


# ---- commit cost in-process ----------------------------------------------------------------
def bench_commit_cost(seconds: float, batch_sizes: tuple[int, ...] = BATCH_SIZES,
                      num_blocks: int = 65_536) -> dict:
    """A full pool churned through the journal in this process (no sockets): CPU and wall time
    of each commit of a round's evictions and seals (what a seal's reply waits for) and of the
    upkeep after it (compaction steps, WAL checkpoints: what the daemon does once the replies
    are out), in the steady state where the log is as long as compaction lets it grow; max wall
    is the longest stall a commit and its upkeep caused together.

    Next to it, the same rounds (alloc → seal → release, and commit + upkeep where there is a
    journal) on a second full pool without one, taking turns slice by slice: the CPU a round
    costs with and without the journal, with no scheduler, socket or cold cache in between —
    the journal's own share of a round, the figure no placement moves."""
    from kvd.server import journal as journal_module
    from kvd.server.journal import Journal
    from kvd.core.pool import BlockPool
    from kvd.runtime import SHM_DIR

    rows = {}
    os.sync()  # the writeback of what ran before (a 1M-block journal) must not slow this part's
    for batch_size in batch_sizes:
        progress(f"commit cost in-process, batch {batch_size} ...")
        with tempfile.TemporaryDirectory(dir=SHM_DIR) as state_dir:  # the default's place
            journal = Journal(state_dir)
            pool = BlockPool(num_blocks, "default", observer=journal)
            plain_pool = BlockPool(num_blocks, "default")
            for start in range(0, num_blocks, 4096):
                for each in (pool, plain_pool):
                    block_ids = each.allocate(4096, OWNER)
                    each.seal(block_ids, digests(start, 4096), OWNER)
                    each.release(block_ids, OWNER)
                journal.commit()
                journal.tidy()
            next_key = num_blocks + churn(pool, journal, first_key=num_blocks)
            samples: dict[str, list[int]] = {step: [] for step in ROUND_STEPS}
            plain: dict[str, list[int]] = {step: [] for step in ROUND_STEPS}
            python: dict[str, list[int]] = {step: [] for step in ROUND_STEPS}
            turns = [(pool, journal, samples), (plain_pool, None, plain)]
            if journal_module.use_c(True):  # and the journal packing records in Python
                turns.append((pool, journal, python))
            for _ in range(NUM_SLICES):  # taking turns: machine noise hits every one alike
                for each, each_journal, each_samples in turns:
                    journal_module.use_c(each_samples is not python)
                    next_key = time_rounds(each, each_journal, batch_size,
                                           seconds / NUM_SLICES / 2, next_key, each_samples)
            journal_module.use_c(True)
            rows[str(batch_size)] = summarise_commits(samples, plain)
            if python["round"]:
                rows[str(batch_size)]["python"] = summarise_commits(python, plain)
            rows[str(batch_size)].update(num_log_records=journal.num_log_records,
                                         num_live=pool.num_cached,
                                         insert_cpu_us=insert_cpu_us(pool, journal, batch_size,
                                                                     seconds / NUM_SLICES,
                                                                     next_key))
            journal.close()
    return {"num_blocks": num_blocks, "batches": rows}


def insert_cpu_us(pool, journal, batch_size: int, seconds: float, next_key: int) -> float:
    """CPU of SQLite's INSERT alone within the commits of a slice of rounds, mean us per
    commit: the journal's cursor timed through a proxy, in a slice of its own (the proxy's call
    costs a little, so the turns above run without it)."""
    cursor, inserts = journal._cursor, []

    class TimedCursor:
        def execute(self, *args):
            started = time.thread_time_ns()
            result = cursor.execute(*args)
            inserts.append(time.thread_time_ns() - started)
            return result

    journal._cursor = TimedCursor()
    try:
        time_rounds(pool, journal, batch_size, seconds, next_key,
                    {step: [] for step in ROUND_STEPS})
    finally:
        journal._cursor = cursor
    return statistics.mean(inserts) / 1e3 if inserts else float("nan")


def time_rounds(pool, journal, batch_size: int, seconds: float, next_key: int,
                samples: dict[str, list[int]]) -> int:
    """alloc → seal → commit → tidy → release rounds for `seconds` (without a journal, the
    commit and tidy steps are calls that do nothing, and every clock is read alike); appends
    nanoseconds per round to `samples` (CPU: seal, commit, tidy, round; wall: commit_wall,
    total_wall = commit and tidy); returns the next unused key."""
    cpu_clock, wall_clock = time.thread_time_ns, time.perf_counter_ns
    commit, tidy = (journal.commit, journal.tidy) if journal is not None else (_nothing, _nothing)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        keys = digests(next_key, batch_size)
        next_key += batch_size
        started = cpu_clock()
        block_ids = pool.allocate(batch_size, OWNER)
        sealing = cpu_clock()
        pool.seal(block_ids, keys, OWNER)
        sealed, wall = cpu_clock(), wall_clock()
        commit()
        committed, committed_wall = cpu_clock(), wall_clock()
        tidy()
        tidied, tidied_wall = cpu_clock(), wall_clock()
        pool.release(block_ids, OWNER)
        done = cpu_clock()
        samples["seal"].append(sealed - sealing)
        samples["commit"].append(committed - sealed)
        samples["commit_wall"].append(committed_wall - wall)
        samples["tidy"].append(tidied - committed)
        samples["total_wall"].append(tidied_wall - wall)
        samples["round"].append(done - started)
    return next_key


def _nothing() -> None:
    pass


def summarise_commits(samples: dict[str, list[int]], plain: dict[str, list[int]]) -> dict:
    commit_wall = sorted(samples["commit_wall"])
    journal_round, plain_round = (statistics.mean(rounds["round"]) for rounds in (samples, plain))
    return {"num_commits": len(samples["commit"]),
            "cpu_us": statistics.mean(samples["commit"]) / 1e3,
            "wall_us_p50": commit_wall[len(commit_wall) // 2] / 1e3,
            "wall_us_p99": commit_wall[len(commit_wall) * 99 // 100] / 1e3,
            "tidy_cpu_us": statistics.mean(samples["tidy"]) / 1e3,
            "total_wall_us_mean": statistics.mean(samples["total_wall"]) / 1e3,
            "total_wall_us_max": max(samples["total_wall"]) / 1e3,
            "seal_cpu_us": statistics.mean(samples["seal"]) / 1e3,
            "plain_seal_cpu_us": statistics.mean(plain["seal"]) / 1e3,
            "round_cpu_us": journal_round / 1e3, "plain_round_cpu_us": plain_round / 1e3,
            "num_plain_rounds": len(plain["round"]),
            "journal_cost": 1 - plain_round / journal_round}


# ---- driver ---------------------------------------------------------------------------------
def print_tables(results: dict) -> None:
    if "recovery" in results:
        print_recovery_table(results["recovery"])
    if "commits" in results:
        print_commit_table(results["commits"])
    for scenario, result in results.get("seal", {}).get("scenarios", {}).items():
        print(f"\nSeal throughput, {scenario} pool of {result['num_blocks']:,} blocks (goal: "
              f"journal cost <= {results['seal']['goal_cost_at_16']:.0%} at batch 16), medians "
              "of rounds; cost = what the journal takes off")
        print_seal_table(result["clients"])


def print_recovery_table(rec: dict) -> None:
    print(f"\nRecovery of a {rec['num_blocks']:,}-block pool after SIGKILL "
          f"(goal <= {rec['goal_s']} s; fill took {rec['fill_s']:.1f} s). The journal's log "
          f"holds {rec['num_log_records']:,} records ({rec['num_churned']:,} blocks replaced "
          "after the fill: as long as compaction lets it grow); its files (database and WAL) "
          f"take {rec['journal_nbytes'] / 2**20:.1f} MiB, "
          f"{rec['journal_nbytes'] / rec['num_blocks']:.0f} B per cached block")
    columns = ("end_to_end_s", "journal_load_s", "segment_attach_s", "pool_build_s",
               "pool_restore_s", "generation_bump_s", "cli_ready_s")
    print("wall s (CPU s of this process: what a busy machine does not inflate)")
    print(f"{'run':>3} " + " ".join(f"{c[:-2]:>17}" for c in columns))
    for index, row in enumerate(rec["runs"], 1):
        print(f"{index:>3} " + " ".join(
            f"{row[c]:8.3f} ({row[c[:-2] + '_cpu_s']:6.3f})" if c[:-2] + "_cpu_s" in row
            else f"{row[c]:17.3f}" for c in columns))


def print_commit_table(commits: dict) -> None:
    print(f"\nOne commit in-process (no sockets), a full pool of {commits['num_blocks']:,} blocks "
          "churned: each allocation evicts, so a commit holds a round's tombstones and seals")
    print(f"{'':5} {'commit (replies wait)':>35} {'upkeep':>8} {'commit + upkeep':>18}")
    print(f"{'batch':>5} {'CPU us':>8} {'INSERT':>8} {'wall p50':>9} {'p99':>7} {'CPU us':>8} "
          f"{'wall mean':>10} {'max us':>7} {'log/live':>9}")
    for batch, row in commits["batches"].items():
        print(f"{batch:>5} {row['cpu_us']:8.1f} {row['insert_cpu_us']:8.1f} "
              f"{row['wall_us_p50']:9.1f} {row['wall_us_p99']:7.1f} {row['tidy_cpu_us']:8.1f} "
              f"{row['total_wall_us_mean']:10.1f} {row['total_wall_us_max']:7.0f} "
              f"{row['num_log_records'] / row['num_live']:9.2f}")
    print("(INSERT: SQLite's INSERT of the commit's chunk alone, CPU us, timed in a slice of its "
          "own)")
    print("\nThe same rounds (alloc → seal → release; commit + upkeep with the journal) on a full "
          "pool with and without a journal, in turns; CPU us per round, means")
    print(f"{'':5} {'round':>17} {'seal':>17} {'journal only':>23} {'records in Python':>26}")
    print(f"{'batch':>5} {'plain':>8} {'journal':>8} {'plain':>8} {'journal':>8} {'commit':>7} "
          f"{'upkeep':>7} {'cost':>7} {'commit':>9} {'upkeep':>7} {'cost':>8}")
    for batch, row in commits["batches"].items():
        python = row.get("python")
        print(f"{batch:>5} {row['plain_round_cpu_us']:8.1f} {row['round_cpu_us']:8.1f} "
              f"{row['plain_seal_cpu_us']:8.1f} {row['seal_cpu_us']:8.1f} {row['cpu_us']:7.1f} "
              f"{row['tidy_cpu_us']:7.1f} {row['journal_cost']:7.1%} "
              + (f"{python['cpu_us']:9.1f} {python['tidy_cpu_us']:7.1f} "
                 f"{python['journal_cost']:8.1%}" if python else f"{'-':>9} {'-':>7} {'-':>8}"))


def print_seal_table(clients: dict) -> None:
    header = ("seal calls k blocks/s", "rounds k blocks/s", "daemon CPU us/block")
    print(f"{'':13}" + "".join(f"{name:>30}" for name in header))
    print(f"{'clients batch':13}" + f"{'plain':>10}{'journal':>10}{'cost':>10}" * len(header))
    for num_clients, batches in clients.items():
        label = num_clients.split("_")[0] + (" 1CPU" if num_clients.endswith("one_cpu") else "")
        for batch, row in batches.items():
            line = f"{label:>7} {batch:>5}"
            for metric, scale in (("seal_call_blocks_per_s", 1e3), ("blocks_per_s", 1e3),
                                  ("cpu_us_per_block", 1)):
                if metric not in row:
                    line += f"{'-':>10}" * 3
                    continue
                cell = row[metric]
                line += (f"{cell['no_journal'] / scale:10.1f}{cell['journal'] / scale:10.1f}"
                         f"{cell['journal_cost']:10.1%}")
            print(line)


def private_runtime_dir() -> str:
    """A runtime dir of this run only (children inherit it)."""
    base = tempfile.mkdtemp(prefix="kvdb-", dir="/tmp")
    os.environ["XDG_RUNTIME_DIR"] = base
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                             os.environ.get("PYTHONPATH")]))
    return base


def run_bench(quick: bool, out: Path) -> str:
    """`python -m bench` calls this (quick: 20,000 blocks, one repeat, 0.2 s per seal point;
    full: 2 s, as the seal rows swing most);
    writes recovery.json and returns the printed tables as a markdown section."""
    saved_env = dict(os.environ)
    base = private_runtime_dir()
    try:
        results = {"recovery": bench_recovery(20_000 if quick else 1_000_000, 1 if quick else 3),
                   "commits": bench_commit_cost(0.2 if quick else 1.0),
                   "seal": bench_seal_throughput(0.2 if quick else 2.0)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved_env)
    write_json(out, "recovery", results)
    return printed_section("Crash recovery and what the journal costs a seal "
                           "(bench/recovery.py)", print_tables, results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="seal time per batch size and mode")
    parser.add_argument("--out", type=Path, help="directory to write recovery.json into")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, of {','.join(PARTS)} (e.g. seal: "
                             "only the seal throughput tables)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="seal rounds per batch size and mode (more: steadier medians)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)),
                        help="comma-separated batch sizes of the commit and seal parts")
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "NAME", "NUM_BLOCKS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        what, name, num_blocks = args.child
        (child_fill if what == "fill" else child_recover)(name, int(num_blocks))
        return
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts takes some of {','.join(PARTS)}, got {args.parts}")
    batch_sizes = tuple(int(size) for size in args.batch_sizes.split(","))
    base = private_runtime_dir()
    try:
        results = {}
        if "recovery" in parts:
            results["recovery"] = bench_recovery(args.num_blocks, args.repeats)
        if "commits" in parts:
            results["commits"] = bench_commit_cost(args.seconds, batch_sizes)
        if "seal" in parts:
            results["seal"] = bench_seal_throughput(args.seconds, batch_sizes, args.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_tables(results)
    if args.out:
        write_json(args.out, "recovery", results)


if __name__ == "__main__":
    main()
