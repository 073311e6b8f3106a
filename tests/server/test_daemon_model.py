"""Model-based test: a Hypothesis state machine drives a real daemon beside a reference model.

Up to three clients — in this process, or in a helper process the test can SIGKILL — alloc,
seal, lookup, pin, release, disconnect and die, on an 8-block pool (so allocations evict and
run out). `PoolModel` is a few dozen lines of plain Python that says what each call must return
or raise. The daemon may choose *which* free or cached blocks an allocation gets (that is the
allocator's and the policy's business), so the model accepts any choice that is legal: distinct
blocks that were free or cached, evicting cached ones only when free ones run short. Everything
else must match exactly. After every step the daemon's state counts, every block's generation
counter and every session's pin count (from the KVD_DEBUG `check_invariants` op, which also runs
the daemon's own invariant checks) must equal the model's.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from stress.stress_procs import RemoteClient, check_invariants

import kvd

NUM_BLOCKS = 8
GEOMETRY = {"layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
NUM_KEYS = 6
MAX_CLIENTS = 3
_example_ids = itertools.count()


class PoolModel:
    """What the daemon's pool must do, in the plainest terms (DESIGN.md section 3)."""

    def __init__(self, num_blocks: int) -> None:
        self.state = ["free"] * num_blocks
        self.refs = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.generation = [0] * num_blocks  # bumps since the example began
        self.index: dict[bytes, int] = {}
        self.pins: dict[int, Counter[int]] = {}  # session id → block → pins

    def count(self, state: str) -> int:
        return self.state.count(state)

    def alloc(self, session: int, num_blocks: int, got: list[int]) -> None:
        """Check the daemon's choice `got` for a legal one and apply it."""
        num_free = self.count("free")
        assert len(got) == num_blocks and len(set(got)) == num_blocks, got
        assert all(self.state[b] in ("free", "cached") for b in got), (got, self.state)
        evicted = [b for b in got if self.state[b] == "cached"]
        assert len(evicted) == max(0, num_blocks - num_free), "evicted more than it needed"
        for block_id in evicted:
            del self.index[self.key[block_id]]
            self._to_free(block_id)
        for block_id in got:
            self.state[block_id], self.refs[block_id] = "owned", 1
            self.pins[session][block_id] += 1

    def can_alloc(self, num_blocks: int) -> bool:
        return num_blocks <= self.count("free") + self.count("cached")

    def seal(self, session: int, block_ids: list[int], keys: list[bytes]) -> list[bool]:
        for block_id in block_ids:
            if block_id not in self.pins[session]:
                raise kvd.NotFoundError
            if self.state[block_id] != "owned":
                raise kvd.InUseError
        if len(set(block_ids)) != len(block_ids):
            raise kvd.BadArgsError
        indexed = []
        for block_id, key in zip(block_ids, keys):
            self.state[block_id], self.key[block_id] = "sealed", key
            indexed.append(key not in self.index)
            self.index.setdefault(key, block_id)
        return indexed

    def lookup(self, session: int, keys: list[bytes]) -> list[int]:
        block_ids = list(itertools.takewhile(lambda b: b is not None,
                                             (self.index.get(key) for key in keys)))
        self._pin(session, block_ids)
        return block_ids

    def pin(self, session: int, block_ids: list[int]) -> None:
        if any(self.state[b] not in ("sealed", "cached") for b in block_ids):
            raise kvd.InUseError
        self._pin(session, block_ids)

    def _pin(self, session: int, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.state[block_id] == "cached":
                self.state[block_id] = "sealed"
            self.refs[block_id] += 1
            self.pins[session][block_id] += 1

    def release(self, session: int, block_ids: list[int]) -> None:
        held = self.pins[session]
        if any(held[b] < n for b, n in Counter(block_ids).items()):
            raise kvd.NotFoundError
        for block_id in block_ids:
            self._unpin(session, block_id)

    def end_session(self, session: int) -> None:
        for block_id, pins in list(self.pins.pop(session).items()):
            for _ in range(pins):
                self.refs[block_id] -= 1
                self._after_unpin(block_id)

    def _unpin(self, session: int, block_id: int) -> None:
        held = self.pins[session]
        held[block_id] -= 1
        if not held[block_id]:
            del held[block_id]
        self.refs[block_id] -= 1
        self._after_unpin(block_id)

    def _after_unpin(self, block_id: int) -> None:
        if self.state[block_id] == "owned":
            self._to_free(block_id)
        elif self.refs[block_id] == 0:
            if self.index.get(self.key[block_id]) == block_id:
                self.state[block_id] = "cached"
            else:  # a duplicate nobody can look up is freed, not cached
                self._to_free(block_id)

    def _to_free(self, block_id: int) -> None:
        self.state[block_id], self.key[block_id], self.refs[block_id] = "free", None, 0
        self.generation[block_id] += 1


class DaemonMachine(RuleBasedStateMachine):
    """A real daemon and `PoolModel`, step by step."""

    def __init__(self, handle: Any) -> None:
        super().__init__()
        self.handle = handle
        self.monitor = handle.connect()
        # Start every example from an all-free pool: allocating every block evicts the cache
        # earlier examples left, and fresh keys (per example) never hit anything they sealed.
        self.monitor.release(self.monitor.alloc(NUM_BLOCKS))
        self.base_generation = [self.monitor.generation(b) for b in range(NUM_BLOCKS)]
        nonce = f"{time.time_ns()}-{next(_example_ids)}".encode()
        self.keys = [hashlib.blake2b(nonce + bytes([i]), digest_size=16).digest()
                     for i in range(NUM_KEYS)]
        self.model = PoolModel(NUM_BLOCKS)
        self.clients: dict[int, Any] = {}  # slot → kvd.Client or RemoteClient

    # ---- plumbing ----------------------------------------------------------------------------
    def call(self, slot: int, method: str, *args: Any) -> Any:
        """Run a client method; a kvd error comes back as its class instead of raising."""
        client = self.clients[slot]
        try:
            if isinstance(client, RemoteClient):
                return client.call(method, *args)
            return getattr(client, method)(*args)
        except kvd.KvdError as exc:
            return type(exc)

    def draw_slot(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.clients)), label="slot")

    @staticmethod
    def draw_blocks(data: st.DataObject, held: list[int], max_size: int) -> list[int]:
        """Mostly blocks the session holds, sometimes any block (to provoke errors).

        Draws indices, not `sampled_from(held)`: which ids the daemon handed out is not part of
        Hypothesis's choices, and its draws must not depend on them."""
        picks = data.draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, NUM_BLOCKS - 1)),
                                   max_size=max_size), label="blocks")
        return [held[i % len(held)] if held and i < 8 else any_id for i, any_id in picks]

    def session(self, slot: int) -> int:
        return self.clients[slot].session_id

    def expect(self, slot: int, method: str, args: tuple[Any, ...], model_call: Any) -> Any:
        """Call the daemon and the model; their results (or error classes) must be equal."""
        try:
            expected = model_call()
        except kvd.KvdError as exc:
            expected = type(exc)
        got = self.call(slot, method, *args)
        assert got == expected, f"{method}{args}: daemon {got!r}, model {expected!r}"
        return got

    def wait_session_gone(self, session_id: int) -> None:
        deadline = time.monotonic() + 5
        while any(s[0] == session_id for s in check_invariants(self.monitor)):
            assert time.monotonic() < deadline, f"session {session_id} was never reclaimed"
            time.sleep(0.001)

    # ---- rules -------------------------------------------------------------------------------
    @precondition(lambda self: len(self.clients) < MAX_CLIENTS)
    @rule(remote=st.booleans())
    def connect(self, remote: bool) -> None:
        slot = min(set(range(MAX_CLIENTS)) - set(self.clients))
        socket_path = self.handle.paths.socket_path
        client = RemoteClient(socket_path) if remote else kvd.connect(socket_path)
        self.clients[slot] = client
        self.model.pins[client.session_id] = Counter()

    @precondition(lambda self: self.clients)
    @rule(data=st.data(), num_blocks=st.integers(0, 4))
    def alloc(self, data: st.DataObject, num_blocks: int) -> None:
        slot = self.draw_slot(data)
        got = self.call(slot, "alloc", num_blocks)
        if not self.model.can_alloc(num_blocks):
            assert got is kvd.NoSpaceError, f"alloc({num_blocks}) should be NO_SPACE, got {got}"
            return
        assert isinstance(got, list), f"alloc({num_blocks}) failed: {got}"
        self.model.alloc(self.session(slot), num_blocks, got)

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def seal(self, data: st.DataObject) -> None:
        slot = self.draw_slot(data)
        block_ids = self.draw_blocks(data, sorted(self.model.pins[self.session(slot)]), 3)
        keys = data.draw(st.lists(st.sampled_from(self.keys), min_size=len(block_ids),
                                  max_size=len(block_ids)))
        self.expect(slot, "seal", (block_ids, keys),
                    lambda: self.model.seal(self.session(slot), block_ids, keys))

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        slot = self.draw_slot(data)
        keys = data.draw(st.lists(st.sampled_from(self.keys), max_size=4))
        self.expect(slot, "lookup", (keys,), lambda: self.model.lookup(self.session(slot), keys))

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        slot = self.draw_slot(data)
        block_ids = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=2))
        self.expect(slot, "pin", (block_ids,), lambda: self.model.pin(self.session(slot),
                                                                        block_ids))

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        slot = self.draw_slot(data)
        held = sorted(self.model.pins[self.session(slot)].elements())
        block_ids = self.draw_blocks(data, held, 4)
        self.expect(slot, "release", (block_ids,),
                    lambda: self.model.release(self.session(slot), block_ids))

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def disconnect_or_kill(self, data: st.DataObject) -> None:
        """Close the socket (a local client) or SIGKILL the process (a remote one)."""
        client = self.clients.pop(self.draw_slot(data))
        if isinstance(client, RemoteClient):
            client.kill()
        else:
            client.close()
        self.wait_session_gone(client.session_id)
        self.model.end_session(client.session_id)

    # ---- checks after every step ---------------------------------------------------------------
    @invariant()
    def daemon_matches_model(self) -> None:
        sessions = {s[0]: s[2] for s in check_invariants(self.monitor)}
        expected = {sid: sum(pins.values()) for sid, pins in self.model.pins.items()}
        expected[self.monitor.session_id] = 0
        assert sessions == expected, f"pins per session: daemon {sessions}, model {expected}"
        stats = self.monitor.stats()
        for state in ("free", "owned", "sealed", "cached"):
            assert stats[state] == self.model.count(state), (state, stats, self.model.state)
        generations = [self.monitor.generation(b) - self.base_generation[b]
                       for b in range(NUM_BLOCKS)]
        assert generations == self.model.generation, "a block's generation counter is off"

    def teardown(self) -> None:
        for client in self.clients.values():
            if isinstance(client, RemoteClient):
                client.kill()
            else:
                client.close()
        for client in self.clients.values():
            self.wait_session_gone(client.session_id)
        self.monitor.close()


@pytest.mark.integration
def test_daemon_matches_reference_model(daemon_factory: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_DEBUG", "1")
    handle = daemon_factory(num_blocks=NUM_BLOCKS, **GEOMETRY)
    run_state_machine_as_test(
        lambda: DaemonMachine(handle),
        settings=settings(max_examples=100, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck), database=None))
