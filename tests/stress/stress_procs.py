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
            "written_blocks", "sealed_blocks", "no_space", "forks", "errors", "holder_pid")
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


def block_bytes(client: kvd.Client, block_id: int) -> np.ndarray:
    return client.view(block_id).view(np.uint8).reshape(-1)


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
    """One worker's random mix of raw block ops and sequence ops, every read verified."""

    def __init__(self, client: kvd.Client, counters: Any, slot: int, seed: int,
                 prompts: list[np.ndarray]) -> None:
        self.client = client
        self.counters = counters
        self.base = slot * NUM_COUNTERS
        self.rng = random.Random(seed)
        self.prompts = prompts
        self.block_size = client.geometry.block_size
        self.nbytes = client.geometry.block_nbytes
        self.held: list[int] = []  # pins kept across cycles, so a kill often catches some

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[self.base + COUNTERS.index(name)] += amount

    def write(self, block_id: int, key: bytes) -> None:
        block_bytes(self.client, block_id)[:] = pattern(key, self.nbytes)
        self.count("written_blocks")

    def verify(self, block_ids: list[int], keys: list[bytes]) -> None:
        """Check pinned blocks hold their keys' patterns and were not reused while read."""
        for block_id, key in zip(block_ids, keys):
            generation = self.client.generation(block_id)
            is_intact = np.array_equal(block_bytes(self.client, block_id),
                                       pattern(key, self.nbytes))
            if not is_intact or self.client.generation(block_id) != generation:
                self.count("corrupt_reads")
            self.count("verified_blocks")

    def run(self, stop: Any) -> None:
        while not stop[0]:
            try:
                self.rng.choice((self.raw_cycle, self.raw_cycle, self.sequence_cycle))()
            except kvd.NoSpaceError:
                self.count("no_space")
            self.count("cycles")

    # ---- raw blocks: lookup, alloc, write, seal, read, pin, release --------------------------
    def raw_cycle(self) -> None:
        tokens = self.rng.choice(self.prompts)
        keys = kvd.hash_blocks(tokens, self.block_size)
        hit_ids = self.client.lookup(keys)
        self.count("hit_blocks", len(hit_ids))
        self.verify(hit_ids, keys)
        try:
            new_ids = self.client.alloc(len(keys) - len(hit_ids))
        except kvd.NoSpaceError:
            self.client.release(hit_ids)
            raise
        if self.rng.random() < 0.1:  # an aborted write: owned blocks go straight back
            self.client.release(hit_ids + new_ids)
            return
        for block_id, key in zip(new_ids, keys[len(hit_ids):]):
            self.write(block_id, key)
        self.client.seal(new_ids, keys[len(hit_ids):])
        self.count("sealed_blocks", len(new_ids))
        block_ids = hit_ids + new_ids
        self.verify(block_ids, keys)
        if self.rng.random() < 0.2:  # share: one more pin each, then drop it
            self.client.pin(block_ids)
            self.client.release(block_ids)
        self.keep_or_release(block_ids)

    def keep_or_release(self, block_ids: list[int]) -> None:
        if self.rng.random() < 0.3 and len(self.held) < len(block_ids):
            self.held += block_ids
            return
        self.client.release(block_ids)
        if self.held and self.rng.random() < 0.5:
            held, self.held = self.held, []
            self.client.release(held)

    # ---- sequences: open, write, commit, extend, fork, close ---------------------------------
    def sequence_cycle(self) -> None:
        tokens = self.rng.choice(self.prompts)
        seq = self.client.open_sequence(tokens)
        seqs = [seq]
        try:
            self.count("seq_cycles")
            num_cached = seq.num_cached_tokens // self.block_size
            self.count("hit_blocks", num_cached)
            keys = kvd.hash_blocks(tokens, self.block_size)
            self.verify(seq.block_ids[:num_cached], keys)
            self.fill(seq, tokens, num_cached)
            self.client.commit_sequence(seq)
            for _ in range(self.rng.randrange(0, 3)):
                tokens = self.extend(seq, tokens)
            if self.rng.random() < 0.5:
                seqs.append(self.fork(seq, tokens))
        finally:
            for each in reversed(seqs):
                self.client.close_sequence(each)

    def fill(self, seq: kvd.Sequence, tokens: np.ndarray, first_block: int) -> None:
        """Write every block from `first_block` on: full ones get their hash's pattern, the
        partial tail one derived from its tokens (it is only ever compared with its fork copy)."""
        keys = kvd.hash_blocks(tokens, self.block_size)
        for index in range(first_block, len(seq.block_ids)):
            self.write(seq.block_ids[index], keys[index] if index < len(keys)
                       else tail_key(tokens, self.block_size))

    def extend(self, seq: kvd.Sequence, tokens: np.ndarray) -> np.ndarray:
        # Decode tokens are a function of the prompt, so extensions are shared across workers.
        step = int(tokens[-1]) % 7 + 1
        new_tokens = (tokens[-1] + np.arange(1, self.block_size + 2) * step).astype(np.uint32)
        num_sealed = seq.num_sealed_blocks
        self.client.extend_sequence(seq, new_tokens, num_computed=seq.num_tokens)
        tokens = np.concatenate([tokens, new_tokens])
        self.fill(seq, tokens, num_sealed)
        self.client.commit_sequence(seq, (len(tokens) // self.block_size) * self.block_size)
        self.count("sealed_blocks", seq.num_sealed_blocks - num_sealed)
        return tokens

    def fork(self, seq: kvd.Sequence, tokens: np.ndarray) -> kvd.Sequence:
        child = self.client.fork_sequence(seq)
        self.count("forks")
        keys = kvd.hash_blocks(tokens, self.block_size)
        num_sealed = seq.num_sealed_blocks
        if child.block_ids[:num_sealed] != seq.block_ids[:num_sealed]:
            self.count("corrupt_reads")  # a fork must share the sealed prefix, not copy it
        self.verify(child.block_ids, keys + [tail_key(tokens, self.block_size)])
        return child


def tail_key(tokens: np.ndarray, block_size: int) -> bytes:
    """A stand-in key for the partial last block of `tokens`."""
    tail = tokens[len(tokens) // block_size * block_size:]
    return hashlib.blake2b(tail.tobytes() + len(tokens).to_bytes(8, "little"),
                           digest_size=16).digest()


def stress_worker_main(socket_path: str, counters: Any, slot: int, seed: int,
                       prompts: list[np.ndarray], fork_holder: bool,
                       pool: str | None = None) -> None:
    """Process entry: connect (to `pool`), optionally fork a child that keeps the socket, run
    until stop."""
    client = kvd.connect(socket_path, pool=pool)
    if fork_holder:
        holder_pid = os.fork()
        if holder_pid == 0:
            hold_socket(counters, os.getppid())
        counters[slot * NUM_COUNTERS + COUNTERS.index("holder_pid")] = holder_pid
    try:
        StressWorker(client, counters, slot, seed, prompts).run(counters)
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
