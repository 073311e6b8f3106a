"""Processes for the stress, model and eviction-safety tests: stress workers and client holders.

Theory of operation
-------------------
Every helper runs in a process forked from a multiprocessing *forkserver* (started once, with
numpy and kvd preloaded): a fork costs milliseconds, so the chaos loop can replace a killed worker
at once, and — unlike a plain fork of the pytest process — the child inherits none of the test's
own kvd connections (an inherited socket would keep the test's session alive after it closes).

A stress worker reports through a shared int64 array (`ctx.Array`) rather than at exit: it is
SIGKILLed at a random instant, and every count it made up to that instant must survive it. Row
`slot` holds one worker's counters (`COUNTERS` names the columns); cell 0 is the global stop flag.

Every block a worker writes carries `pattern(key)`: the block's bytes are its 16-byte content hash
repeated, so any reader that knows the hash it looked up can verify the bytes it got, byte for
byte. A reader holds a pin while it reads, so the bytes must match and the block's generation
counter must not move; either failure is counted as a corrupt read.

Several pools: a worker given several pools picks one per cycle in one session (OP@POOL), and
given a model it also runs sequences spanning the model's pools (each pool's blocks hold the
pattern of the same hash chain). A daemon restart (`kvd start --recover` between a worker's calls)
reconnects the worker; its pins and sequences died with the old session, and a read that the
restart cut (its pins gone while it read) is not counted: the worker asks the daemon after a
mismatch, and only a session still alive then proves the pins held throughout the read.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import time
from typing import Any

import numpy as np

import kvd

COUNTERS = ("cycles", "seq_cycles", "verified_blocks", "corrupt_reads", "hit_blocks",
            "written_blocks", "sealed_blocks", "no_space", "forks", "errors", "holder_pid",
            "model_cycles", "restarts", "reads_cut_by_restart")
NUM_COUNTERS = len(COUNTERS)
HOLD_AFTER_PARENT_DEATH_S = 2.0  # a forked child keeps its dead parent's socket this long

_context: Any = None


def context() -> Any:
    """The forkserver context every helper process comes from (started on first use)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["numpy", "kvd", __name__])
    return _context


def check_invariants(client: kvd.Client) -> list[list[int]]:
    """The daemon's KVD_DEBUG `check_invariants` op: `[session_id, pid, pins]` per session.

    The client library has no method for a debug-only op, hence the private `_call`.
    """
    return client._call("check_invariants", {})


def pattern(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes a block sealed (or to be sealed) under `key` must hold."""
    return np.resize(np.frombuffer(key, dtype=np.uint8), nbytes)


def block_bytes(client: kvd.Client, block_id: int, pool: str | None = None) -> np.ndarray:
    return client.view(block_id, pool).view(np.uint8).reshape(-1)


# ---- the shared prompt universe --------------------------------------------------------------
def make_prompts(seed: int, num_families: int, block_size: int) -> list[np.ndarray]:
    """Prompts that share prefixes: each family has one prefix and several suffixes.

    Prompts end with a partial block, so sequences also have an unsealed tail to fork.
    """
    rng = random.Random(seed)
    prompts = []
    for family in range(num_families):
        prefix = [family * 1_000_000 + i for i in range(6 * block_size)]
        for variant in range(8):
            num_suffix_tokens = rng.randrange(3, 9) * block_size + rng.randrange(1, block_size)
            suffix = [family * 1_000_000 + (variant + 1) * 10_000 + i
                      for i in range(num_suffix_tokens)]
            prompts.append(np.array(prefix + suffix, dtype=np.uint32))
    return prompts


def num_distinct_blocks(prompts: list[np.ndarray], block_size: int) -> int:
    return len({key for tokens in prompts for key in kvd.hash_blocks(tokens, block_size)})


# ---- the stress worker -----------------------------------------------------------------------
class StressWorker:
    """One worker's random mix of raw block ops and sequence ops (in `pools`, one per cycle, and
    across `model`'s pools), every read verified."""

    def __init__(self, client: kvd.Client, counters: Any, slot: int, seed: int,
                 prompts: list[np.ndarray], pools: tuple[str | None, ...] = (None,),
                 model: str | None = None) -> None:
        self.client = client
        self.counters = counters
        self.base = slot * NUM_COUNTERS
        self.rng = random.Random(seed)
        self.prompts = prompts
        self.pools = pools
        self.model = model
        self.block_size = client.geometry.block_size  # (a model's pools share it)
        self.nbytes = {pool: (client.geometry if pool is None else client.pools[pool]
                              ).block_nbytes for pool in (*pools, *client.info["models"].get(
                                  model, ()))}
        self.held: dict[str | None, list[int]] = {}  # pins kept across cycles, so a kill often
        # catches some
        self.epoch = client.num_reconnects

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[self.base + COUNTERS.index(name)] += amount

    def write(self, block_id: int, key: bytes, pool: str | None) -> None:
        block_bytes(self.client, block_id, pool)[:] = pattern(key, self.nbytes[pool])
        self.count("written_blocks")

    def verify(self, block_ids: list[int], keys: list[bytes], pool: str | None) -> None:
        """Check pinned blocks hold their keys' patterns and were not reused while read (-1: a
        window pool released that block)."""
        for block_id, key in zip(block_ids, keys):
            if block_id == -1:
                continue
            generation = self.client.generation(block_id, pool)
            is_intact = np.array_equal(block_bytes(self.client, block_id, pool),
                                       pattern(key, self.nbytes[pool]))
            if not is_intact or self.client.generation(block_id, pool) != generation:
                self.count("reads_cut_by_restart" if self.cut_by_restart() else "corrupt_reads")
            self.count("verified_blocks")

    def cut_by_restart(self) -> bool:
        """Whether the daemon restarted since this cycle began (a call that notices it)."""
        self.client.stats()  # (sent again after a restart: it reconnects)
        return self.client.num_reconnects != self.epoch

    def run(self, stop: Any) -> None:
        cycles = [self.raw_cycle, self.raw_cycle, self.sequence_cycle]
        if self.model is not None:
            cycles += [self.model_cycle] * 2
        while not stop[0]:
            if self.client.num_reconnects != self.epoch:  # the old session's pins died
                self.epoch, self.held = self.client.num_reconnects, {}
                self.count("restarts")
            try:
                self.rng.choice(cycles)(self.rng.choice(self.pools))
            except kvd.KvdError as exc:
                if self.client.num_reconnects == self.epoch:  # (else the daemon restarted mid-
                    if not isinstance(exc, kvd.NoSpaceError):  # cycle: the old session's ids
                        raise  # may name the new one's blocks)
                    self.count("no_space")
            self.count("cycles")

    # ---- raw blocks: lookup, alloc, write, seal, read, pin, release --------------------------
    def raw_cycle(self, pool: str | None) -> None:
        tokens = self.rng.choice(self.prompts)
        keys = kvd.hash_blocks(tokens, self.block_size)
        hit_ids = self.client.lookup(keys, pool)
        self.count("hit_blocks", len(hit_ids))
        self.verify(hit_ids, keys, pool)
        try:
            new_ids = self.client.alloc(len(keys) - len(hit_ids), pool)
        except kvd.NoSpaceError:
            self.client.release(hit_ids, pool)
            raise
        if self.rng.random() < 0.1:  # an aborted write: owned blocks go straight back
            self.client.release(hit_ids + new_ids, pool)
            return
        for block_id, key in zip(new_ids, keys[len(hit_ids):]):
            self.write(block_id, key, pool)
        self.client.seal(new_ids, keys[len(hit_ids):], pool=pool)
        self.count("sealed_blocks", len(new_ids))
        block_ids = hit_ids + new_ids
        self.verify(block_ids, keys, pool)
        if self.rng.random() < 0.2:  # share: one more pin each, then drop it
            self.client.pin(block_ids, pool)
            self.client.release(block_ids, pool)
        self.keep_or_release(block_ids, pool)

    def keep_or_release(self, block_ids: list[int], pool: str | None) -> None:
        if self.client.num_reconnects != self.epoch:
            self.held = {}  # (died with the old session)
        held = self.held.setdefault(pool, [])
        if self.rng.random() < 0.3 and len(held) < len(block_ids):
            held += block_ids
            return
        self.client.release(block_ids, pool)
        if held and self.rng.random() < 0.5:
            self.client.release(self.held.pop(pool), pool)

    # ---- sequences: open, write, commit, extend, fork, close ---------------------------------
    def sequence_cycle(self, pool: str | None) -> None:
        tokens = self.rng.choice(self.prompts)
        seq = self.client.open_sequence(tokens, pool=pool)
        seqs = [seq]
        try:
            self.count("seq_cycles")
            tables = {pool: seq.block_ids}
            self.opened(tables, tokens, seq.num_cached_tokens // self.block_size)
            self.client.commit_sequence(seq)
            for _ in range(self.rng.randrange(0, 3)):
                num_sealed = seq.num_sealed_blocks
                tokens = self.extend(seq, tokens, self.client.extend_sequence)
                self.fill(tables, tokens, num_sealed)  # (before the commit seals them)
                self.client.commit_sequence(seq, self.aligned(tokens))
                self.count("sealed_blocks", seq.num_sealed_blocks - num_sealed)
            if self.rng.random() < 0.5:
                child = self.client.fork_sequence(seq)
                seqs.append(child)
                self.forked(tables, {pool: child.block_ids}, tokens, seq.num_sealed_blocks)
        finally:
            for each in reversed(seqs):
                self.client.close_sequence(each)

    def model_cycle(self, _: str | None) -> None:
        """The sequence cycle on the model: one sequence spanning its pools."""
        tokens = self.rng.choice(self.prompts)
        seq = self.client.open_model_sequence(self.model, tokens)
        seqs = [seq]
        try:
            self.count("model_cycles")
            self.opened(seq.block_ids, tokens, seq.num_cached_tokens // self.block_size)
            self.client.commit_model_sequence(seq)
            for _ in range(self.rng.randrange(0, 3)):
                num_sealed = seq.num_sealed_blocks
                tokens = self.extend(seq, tokens, self.client.extend_model_sequence)
                self.fill(seq.block_ids, tokens, num_sealed)
                self.client.commit_model_sequence(seq, self.aligned(tokens))
            if self.rng.random() < 0.5:
                child = self.client.fork_model_sequence(seq)
                seqs.append(child)
                self.forked(seq.block_ids, child.block_ids, tokens, seq.num_sealed_blocks)
        finally:
            for each in reversed(seqs):
                self.client.close_model_sequence(each)

    def opened(self, tables: dict[str | None, list[int]], tokens: np.ndarray,
               num_cached: int) -> None:
        """A sequence opened with `num_cached` blocks found: verify them, write the rest."""
        self.count("hit_blocks", num_cached)
        keys = kvd.hash_blocks(tokens, self.block_size)
        for pool, block_ids in tables.items():
            self.verify(block_ids[:num_cached], keys, pool)
        self.fill(tables, tokens, num_cached)

    def aligned(self, tokens: np.ndarray) -> int:
        return len(tokens) // self.block_size * self.block_size

    def fill(self, tables: dict[str | None, list[int]], tokens: np.ndarray,
             first_block: int) -> None:
        """Write every block from `first_block` on: full ones get their hash's pattern, the
        partial tail one derived from its tokens (it is only ever compared with its fork copy);
        -1: a window pool released it."""
        keys = kvd.hash_blocks(tokens, self.block_size)
        for pool, block_ids in tables.items():
            for index in range(first_block, len(block_ids)):
                if block_ids[index] != -1:
                    self.write(block_ids[index], keys[index] if index < len(keys)
                               else tail_key(tokens, self.block_size), pool)

    def extend(self, seq: Any, tokens: np.ndarray, extend: Any) -> np.ndarray:
        """Append a block and a token, sealing what was computed before them."""
        # Decode tokens are a function of the prompt, so extensions are shared across workers.
        step = int(tokens[-1]) % 7 + 1
        new_tokens = (tokens[-1] + np.arange(1, self.block_size + 2) * step).astype(np.uint32)
        extend(seq, new_tokens, num_computed=seq.num_tokens)
        return np.concatenate([tokens, new_tokens])

    def forked(self, parent: dict[str | None, list[int]], child: dict[str | None, list[int]],
               tokens: np.ndarray, num_sealed: int) -> None:
        """A fork must share the sealed prefix, not copy it, and hold the same bytes."""
        self.count("forks")
        keys = kvd.hash_blocks(tokens, self.block_size) + [tail_key(tokens, self.block_size)]
        for pool, block_ids in child.items():
            if block_ids[:num_sealed] != parent[pool][:num_sealed]:
                self.count("corrupt_reads")
            self.verify(block_ids, keys, pool)


def tail_key(tokens: np.ndarray, block_size: int) -> bytes:
    """A stand-in key for the partial last block of `tokens`."""
    tail = tokens[len(tokens) // block_size * block_size:]
    return hashlib.blake2b(tail.tobytes() + len(tokens).to_bytes(8, "little"),
                           digest_size=16).digest()


def stress_worker_main(socket_path: str, counters: Any, slot: int, seed: int,
                       prompts: list[np.ndarray], fork_holder: bool,
                       pools: tuple[str | None, ...] = (None,), model: str | None = None
                       ) -> None:
    """Process entry: connect (with one pool, to it), optionally fork a child that keeps the
    socket, run until stop."""
    client = kvd.connect(socket_path, pool=pools[0] if len(pools) == 1 else None)
    if fork_holder:
        holder_pid = os.fork()
        if holder_pid == 0:
            hold_socket(counters, os.getppid())
        counters[slot * NUM_COUNTERS + COUNTERS.index("holder_pid")] = holder_pid
    try:
        StressWorker(client, counters, slot, seed, prompts, pools, model).run(counters)
    except Exception:
        counters[slot * NUM_COUNTERS + COUNTERS.index("errors")] += 1
        raise
    finally:
        client.close()


def hold_socket(counters: Any, parent_pid: int) -> None:
    """In a forked child: keep the inherited socket open while the parent lives and a while
    after it died (so the daemon sees EOF late), then exit without any cleanup."""
    while not counters[0] and os.getppid() == parent_pid:
        time.sleep(0.01)
    deadline = time.monotonic() + HOLD_AFTER_PARENT_DEATH_S
    while not counters[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0)


# ---- a client held in another process (model test, eviction safety) -------------------------
def holder_main(socket_path: str, pipe: Any) -> None:
    """Serve `(method, args)` calls on one kvd client over `pipe`; replies `(ok, value)`.

    `("write", (block_id, key))` fills a block with `pattern(key)`; any other method is a Client
    method. Errors come back as `(False, (class name, message))`.
    """
    with kvd.connect(socket_path) as client:
        pipe.send((True, client.session_id))
        while True:
            method, args = pipe.recv()
            try:
                if method == "write":
                    block_id, key = args
                    block_bytes(client, block_id)[:] = pattern(key, client.geometry.block_nbytes)
                    value = None
                else:
                    value = getattr(client, method)(*args)
                pipe.send((True, value))
            except kvd.KvdError as exc:
                pipe.send((False, (type(exc).__name__, str(exc))))


class RemoteClient:
    """A kvd client living in a helper process, so the test can SIGKILL it."""

    def __init__(self, socket_path: str) -> None:
        self._pipe, child_pipe = context().Pipe()
        self.process = context().Process(target=holder_main, args=(socket_path, child_pipe),
                                         daemon=True)
        self.process.start()
        child_pipe.close()
        _, self.session_id = self._pipe.recv()  # holder_main's first message: its session id
        self.pid = self.process.pid

    def call(self, method: str, *args: Any) -> Any:
        """Run `method` in the helper; re-raise a kvd error as the same class here."""
        self._pipe.send((method, args))
        is_ok, value = self._pipe.recv()
        if not is_ok:
            name, message = value
            raise getattr(kvd.errors, name)(message)
        return value

    def kill(self) -> None:
        """SIGKILL the helper (the daemon must reclaim its session) and reap it."""
        self.process.kill()
        self.process.join()
        self._pipe.close()


# ---- eviction-safety race: readers pin and verify while churners evict and overwrite --------
RACE_COUNTERS = ("verified_blocks", "corrupt_reads", "published", "churned_blocks")


def race_main(role: str, socket_path: str, keys: list[bytes], counters: Any, slot: int) -> None:
    """`reader`: pin each key's block, read it three times, release. `publisher`: seal any key
    that is missing. `churner`: allocate as much as it can (evicting every unpinned block),
    overwrite it with 0xFF and free it again. Runs until `counters[0]` is set."""
    base = slot * len(RACE_COUNTERS)
    with kvd.connect(socket_path) as client:
        step = {"reader": _race_read, "publisher": _race_publish, "churner": _race_churn}[role]
        rng = random.Random(slot)
        while not counters[0]:
            for name, amount in step(client, keys, rng).items():
                counters[base + RACE_COUNTERS.index(name)] += amount


def _race_read(client: kvd.Client, keys: list[bytes], rng: random.Random) -> dict[str, int]:
    key = rng.choice(keys)
    block_ids = client.lookup([key])
    corrupt = 0
    for block_id in block_ids:
        generation = client.generation(block_id)
        for _ in range(3):
            if not np.array_equal(block_bytes(client, block_id),
                                  pattern(key, client.geometry.block_nbytes)):
                corrupt += 1
        corrupt += client.generation(block_id) != generation
    client.release(block_ids)
    return {"verified_blocks": 3 * len(block_ids), "corrupt_reads": corrupt}


def _race_publish(client: kvd.Client, keys: list[bytes], rng: random.Random) -> dict[str, int]:
    key = rng.choice(keys)
    block_ids = client.lookup([key])
    if not block_ids:
        try:
            block_ids = client.alloc(1)
        except kvd.NoSpaceError:
            return {}
        block_bytes(client, block_ids[0])[:] = pattern(key, client.geometry.block_nbytes)
        client.seal(block_ids, [key])
    client.release(block_ids)  # while readers may still be reading it
    return {"published": 1}


def _race_churn(client: kvd.Client, keys: list[bytes], rng: random.Random) -> dict[str, int]:
    num_blocks = rng.randrange(1, client.geometry.num_blocks + 1)
    while num_blocks:
        try:
            block_ids = client.alloc(num_blocks)
            break
        except kvd.NoSpaceError:
            num_blocks //= 2
    else:
        return {}
    for block_id in block_ids:
        block_bytes(client, block_id)[:] = 0xFF
    client.release(block_ids)
    return {"churned_blocks": len(block_ids)}
