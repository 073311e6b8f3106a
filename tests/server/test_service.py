"""kvd.server.service.Service without a daemon: sessions, hello, every op, refusals that change nothing.

The daemon only frames bytes around `Service.handle`, so each wire op's semantics and its typed
errors are tested here directly; tests/test_daemon.py checks the same codes over a real socket.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import (
    BadArgsError, InUseError, NoSpaceError, NotFoundError, ProtocolError, TooLargeError,
    UnknownOpError, VersionError,
)
from kvd.geometry import Geometry
from kvd.hashing import hash_blocks, token_bytes
from kvd.core.pool import BlockPool
from kvd import native, protocol
from kvd.protocol import PROTOCOL_VERSION
from kvd.server.service import MAX_BATCH, Limits, Service

GEOMETRY = Geometry(num_blocks=16, num_layers=1, block_size=4, num_kv_heads=1, head_dim=2,
                    dtype="float32")
HASHES = hash_blocks(np.arange(16), 4)


class Harness:
    def __init__(self) -> None:
        self.pool = BlockPool(GEOMETRY.num_blocks, "lru")
        self.blocks = np.zeros(GEOMETRY.pool_shape, dtype=np.float32)

        def copy_block(src: int, dst: int) -> None:
            self.blocks[dst] = self.blocks[src]

        self.service = Service(self.pool, GEOMETRY, copy_block, {"segment": "/kvd-test"})

    def session(self, pid: int = 4242):
        session = self.service.open_session(pid, 0)
        self.service.handle(session, "hello", {"version": PROTOCOL_VERSION})
        return session

    def state(self) -> tuple:
        """Everything a refused request must leave untouched."""
        stats = self.service.stats()
        keys = ("free", "owned", "sealed", "cached", "indexed", "allocations", "evictions",
                "seals", "sessions", "sequences")
        return (tuple(stats[k] for k in keys),
                {owner: self.pool.holdings(owner) for owner in self.pool.owners()},
                {sid: sorted(s.seq_ids) for sid, s in self.service.sessions.items()})


@pytest.fixture
def h() -> Harness:
    harness = Harness()
    yield harness
    harness.pool.check_invariants()


def test_hello_returns_geometry_versions_and_info(h):
    session = h.service.open_session(1, 0)
    reply = h.service.handle(session, "hello", {"version": PROTOCOL_VERSION, "pid": 1})
    assert Geometry.from_dict(reply["geometry"]) == GEOMETRY
    assert reply["protocol_version"] == PROTOCOL_VERSION
    assert reply["session_id"] == session.session_id and reply["segment"] == "/kvd-test"
    assert session.is_ready


def test_every_op_but_hello_is_refused_before_hello(h):
    session = h.service.open_session(1, 0)
    for op in ("alloc", "stats", "seq_open", "lookup"):
        with pytest.raises(ProtocolError, match="hello"):
            h.service.handle(session, op, {})


def test_wrong_protocol_version_is_refused_and_the_session_stays_unready(h):
    session = h.service.open_session(1, 0)
    with pytest.raises(VersionError, match="protocol"):
        h.service.handle(session, "hello", {"version": PROTOCOL_VERSION + 1})
    assert not session.is_ready


def test_unknown_op_names_the_valid_ones(h):
    with pytest.raises(UnknownOpError, match="alloc"):
        h.service.handle(h.session(), "explode", {})


def test_alloc_seal_lookup_release_across_two_sessions(h):
    a, b = h.session(1), h.session(2)
    block_ids = h.service.handle(a, "alloc", {"num_blocks": 2})
    assert h.service.handle(a, "seal", {"block_ids": block_ids, "hashes": HASHES[:2]}) == [True] * 2
    assert h.service.handle(b, "lookup", {"hashes": HASHES[:3]}) == block_ids
    assert [h.pool.ref_count(i) for i in block_ids] == [2, 2]
    h.service.handle(a, "release", {"block_ids": block_ids})
    h.service.handle(b, "release", {"block_ids": block_ids})
    assert h.pool.num_cached == 2
    stats = h.service.stats()
    assert (stats["lookups"], stats["lookup_blocks"], stats["hit_blocks"]) == (1, 3, 2)


@pytest.mark.parametrize("op, args, error", [
    ("alloc", {"num_blocks": -1}, BadArgsError),
    ("alloc", {"num_blocks": 17}, BadArgsError),
    ("alloc", {"num_blocks": True}, BadArgsError),
    ("alloc", {"num_blocks": 1, "extra": 1}, BadArgsError),
    ("alloc", {}, BadArgsError),
    ("seal", {"block_ids": [0], "hashes": [b""]}, BadArgsError),
    ("seal", {"block_ids": [0], "hashes": [b"x" * 65]}, BadArgsError),
    ("seal", {"block_ids": [0], "hashes": ["text"]}, BadArgsError),
    ("seal", {"block_ids": [99], "hashes": [b"h"]}, BadArgsError),
    ("seal", {"block_ids": [15], "hashes": [b"h"]}, NotFoundError),  # not this session's
    ("seal", {"block_ids": [0, 1], "hashes": [b"h"]}, BadArgsError),
    ("seal", {"block_ids": [1], "hashes": [b"h"], "parents": [b"p", None]}, BadArgsError),
    ("seal", {"block_ids": [1], "hashes": [b"h"], "parents": [b""]}, BadArgsError),
    ("seal", {"block_ids": [1], "hashes": [b"h"], "parents": b"p"}, BadArgsError),
    ("seal", {"block_ids": [1], "hashes": [b"h"], "tiers": [2]}, BadArgsError),
    ("seal", {"block_ids": [1], "hashes": [b"h"], "tiers": [0, 1]}, BadArgsError),
    ("lookup", {"hashes": b"not a list"}, BadArgsError),
    ("release", {"block_ids": [15]}, NotFoundError),
    ("release", {"block_ids": [-1]}, BadArgsError),
    ("pin", {"block_ids": [15]}, InUseError),  # free: only sealed blocks can be shared
    ("seq_open", {"tokens": b"\x01\x00\x00"}, BadArgsError),
    ("seq_open", {"tokens": b""}, BadArgsError),
    ("seq_open", {"tokens": token_bytes([1]), "salt": b"s" * 257}, BadArgsError),
    ("seq_extend", {"seq_id": 12345, "tokens": b""}, NotFoundError),
    ("seq_commit", {"seq_id": 12345}, NotFoundError),
    ("seq_fork", {"seq_id": "1"}, BadArgsError),
    ("seq_close", {"seq_id": 12345}, NotFoundError),
    ("seq_info", {}, BadArgsError),
    ("stats", {"verbose": True}, BadArgsError),
])
def test_a_refused_request_changes_nothing(h, op, args, error):
    session = h.session()
    owned = h.service.handle(session, "alloc", {"num_blocks": 2})
    h.service.handle(session, "seal", {"block_ids": owned[:1], "hashes": HASHES[:1]})
    before = h.state()
    with pytest.raises(error):
        h.service.handle(session, op, args)
    assert h.state() == before


def test_sealing_a_sealed_block_is_in_use_and_changes_nothing(h):
    session = h.session()
    block_ids = h.service.handle(session, "alloc", {"num_blocks": 1})
    h.service.handle(session, "seal", {"block_ids": block_ids, "hashes": HASHES[:1]})
    before = h.state()
    with pytest.raises(InUseError):
        h.service.handle(session, "seal", {"block_ids": block_ids, "hashes": HASHES[1:2]})
    assert h.state() == before


def test_alloc_beyond_free_and_evictable_is_no_space_and_changes_nothing(h):
    session = h.session()
    h.service.handle(session, "alloc", {"num_blocks": 10})
    before = h.state()
    with pytest.raises(NoSpaceError, match="--num-blocks"):
        h.service.handle(session, "alloc", {"num_blocks": 7})
    assert h.state() == before


def test_a_session_cannot_touch_another_sessions_sequence(h):
    a, b = h.session(1), h.session(2)
    seq = h.service.handle(a, "seq_open", {"tokens": token_bytes(range(5))})
    before = h.state()
    for op in ("seq_info", "seq_commit", "seq_fork", "seq_close"):
        with pytest.raises(NotFoundError):
            h.service.handle(b, op, {"seq_id": seq["seq_id"]})
    assert h.state() == before


def test_sequence_ops_round_trip(h):
    session = h.session()
    seq = h.service.handle(session, "seq_open", {"tokens": token_bytes(range(6))})
    assert (seq["num_tokens"], seq["num_cached_tokens"], len(seq["block_ids"])) == (6, 0, 2)
    new = h.service.handle(session, "seq_extend", {"seq_id": seq["seq_id"],
                                                   "tokens": token_bytes(range(6, 9))})
    assert len(new) == 1  # and block 0 (tokens 0-3, computed before the call) is sealed
    assert h.service.handle(session, "seq_commit", {"seq_id": seq["seq_id"]}) == 1
    info = h.service.handle(session, "seq_info", {"seq_id": seq["seq_id"]})
    assert (info["num_tokens"], info["num_sealed_blocks"]) == (9, 2)
    child = h.service.handle(session, "seq_fork", {"seq_id": seq["seq_id"]})
    assert child["block_ids"][:2] == info["block_ids"][:2]
    h.service.handle(session, "seq_close", {"seq_id": seq["seq_id"]})
    h.service.handle(session, "seq_close", {"seq_id": child["seq_id"]})
    stats = h.service.stats()
    assert (stats["sequences"], stats["owned"], stats["sealed"], stats["cached"]) == (0, 0, 0, 2)


def test_extend_rejects_num_computed_beyond_the_sequence(h):
    session = h.session()
    seq = h.service.handle(session, "seq_open", {"tokens": token_bytes(range(3))})
    before = h.state()
    with pytest.raises(BadArgsError):
        h.service.handle(session, "seq_extend", {"seq_id": seq["seq_id"], "tokens": b"",
                                                 "num_computed": 4})
    assert h.state() == before


def test_close_session_releases_raw_pins_and_every_sequence(h):
    a, b = h.session(1), h.session(2)
    owned = h.service.handle(a, "alloc", {"num_blocks": 3})
    h.service.handle(a, "seal", {"block_ids": owned[:2], "hashes": HASHES[:2]})
    seq = h.service.handle(a, "seq_open", {"tokens": token_bytes(range(9))})
    h.service.handle(a, "seq_fork", {"seq_id": seq["seq_id"]})
    pinned_by_b = h.service.handle(b, "lookup", {"hashes": HASHES[:1]})
    assert h.service.close_session(a) == 3 + 3 + 1  # raw pins, the sequence's, the fork's copy
    assert h.service.close_session(a) == 0  # idempotent: EOF and pidfd may both report it
    # Queued, then released a bounded step at a time (the loop does one step per iteration).
    assert h.service.stats()["owned"] > 0
    assert h.service.release_deferred(4) and not h.service.release_deferred(4)
    h.service.check_invariants()
    stats = h.service.stats()
    assert (stats["owned"], stats["sequences"], stats["sessions"]) == (0, 0, 1)
    assert (stats["sealed"], stats["cached"]) == (1, 1)  # b still pins the first block
    assert h.pool.holdings(b.session_id) == {pinned_by_b[0]: 1}
    assert (stats["sessions_opened"], stats["sessions_closed"]) == (2, 1)


def test_stats_reports_the_documented_keys(h):
    stats = h.service.handle(h.session(), "stats", {})
    for key in ("free", "owned", "sealed", "cached", "num_blocks", "allocations", "evictions",
                "lookups", "hit_blocks", "prompt_tokens", "cached_tokens", "sessions",
                "sequences", "policy", "uptime_s", "geometry", "requests", "errors", "codec"):
        assert key in stats
    assert stats["policy"] == "lru"
    assert stats["codec"] == protocol.codec()
    assert stats["native"] == native.status() and set(stats["native"]) == set(native.MODULES)


def test_seal_with_parents_links_the_chain_so_eviction_never_strands_a_middle(h):
    a = h.session()
    block_ids = h.service.handle(a, "alloc", {"num_blocks": 3})
    sealed = h.service.handle(a, "seal", {"block_ids": block_ids, "hashes": HASHES[:3],
                                          "parents": [None, *HASHES[:2]], "tiers": [0, 0, 1]})
    assert sealed == [True] * 3
    h.service.handle(a, "release", {"block_ids": block_ids[:1]})  # the head is evicted first...
    h.service.handle(a, "release", {"block_ids": block_ids[1:]})
    h.service.handle(a, "alloc", {"num_blocks": 14})  # ...13 free blocks: one eviction
    assert [h.pool.find(key) for key in HASHES[:3]] == [None] * 3  # ...taking its chain along
    assert h.service.stats()["evictions"] == 3


def test_no_reply_can_outgrow_a_frame_after_the_pool_changed():
    """Regression: alloc took up to the whole pool and a sequence any length, so on a pool of
    600k blocks alloc(500_000) (or seq_open with block size 1) allocated, then its reply of ids
    was over the frame cap: TOO_LARGE, with the blocks owned by a session that never learned
    their ids. Both are refused up front now, and every reply fits a frame."""
    num_blocks = 3 * MAX_BATCH
    geometry = Geometry(num_blocks=num_blocks, num_layers=1, block_size=1, num_kv_heads=1,
                        head_dim=1, dtype="float32")
    service = Service(BlockPool(num_blocks, "lru"), geometry, lambda src, dst: None, {})
    session = service.open_session(1, 0)
    service.handle(session, "hello", {"version": PROTOCOL_VERSION})
    with pytest.raises(BadArgsError, match="num_blocks"):
        service.handle(session, "alloc", {"num_blocks": MAX_BATCH + 1})
    with pytest.raises(BadArgsError, match=f"at most {MAX_BATCH} blocks"):
        service.handle(session, "seq_open", {"tokens": token_bytes(range(MAX_BATCH + 1))})
    seq = service.handle(session, "seq_open", {"tokens": token_bytes(range(MAX_BATCH - 1))})
    with pytest.raises(BadArgsError, match=f"at most {MAX_BATCH} blocks"):
        service.handle(session, "seq_extend", {"seq_id": seq["seq_id"],
                                               "tokens": token_bytes([1, 2])})
    assert service.stats()["owned"] == MAX_BATCH - 1  # the refusals changed nothing
    biggest = [service.handle(session, "alloc", {"num_blocks": MAX_BATCH}), seq,
               service.handle(session, "seq_fork", {"seq_id": seq["seq_id"]})]
    for reply in biggest:
        protocol.FrameEncoder().frame([1, True, reply])  # raises TooLargeError above the cap


def limited(**limits) -> tuple[Service, object]:
    service = Service(BlockPool(GEOMETRY.num_blocks, "lru"), GEOMETRY, lambda src, dst: None, {},
                      limits=Limits(**limits))
    session = service.open_session(1, 0)
    service.handle(session, "hello", {"version": PROTOCOL_VERSION})
    return service, session


@pytest.mark.parametrize("limit, ops, flag", [
    ({"max_sequences": 2}, ["open", "open", "open"], "--max-sequences"),
    ({"max_sequences": 2}, ["open", "fork", "fork"], "--max-sequences"),
    ({"max_forks": 2}, ["open", "fork", "fork", "fork"], "--max-forks"),
    ({"max_pins": 5}, ["open", "open", "open"], "--max-pins"),  # 2 blocks each
    ({"max_pins": 3}, ["open", "extend", "extend"], "--max-pins"),  # 2, 3, then 4 blocks
])
def test_a_session_past_a_limit_gets_too_large_naming_the_flag_and_nothing_changes(limit, ops,
                                                                                    flag):
    service, session = limited(**limit)
    tokens = token_bytes(range(GEOMETRY.block_size + 1))
    seq_id = None
    for index, op in enumerate(ops):
        call = {"open": ("seq_open", {"tokens": tokens}),
                "fork": ("seq_fork", {"seq_id": seq_id}),
                "extend": ("seq_extend", {"seq_id": seq_id, "tokens": tokens})}[op]
        if index < len(ops) - 1:
            reply = service.handle(session, *call)
            seq_id = seq_id or reply["seq_id"]
            continue
        before = (service.pool.stats(), len(service.page_table.sequences), session.num_pins)
        with pytest.raises(TooLargeError, match=f"limit of .*kvd start {flag}"):
            service.handle(session, *call)
        assert (service.pool.stats(), len(service.page_table.sequences),
                session.num_pins) == before
    service.check_invariants()
    service.close_session(session)
    assert not service.release_deferred(1 << 20)
    service.check_invariants()


def test_closing_forks_gives_their_limits_back():
    service, session = limited(max_forks=1, max_pins=3)
    seq = service.handle(session, "seq_open", {"tokens": token_bytes(range(5))})
    service.handle(session, "seq_commit", {"seq_id": seq["seq_id"], "num_computed": 4})
    for _ in range(3):  # 2 pins, the fork's copy of the unsealed block: within both limits
        child = service.handle(session, "seq_fork", {"seq_id": seq["seq_id"]})
        service.handle(session, "seq_close", {"seq_id": child["seq_id"]})
        assert session.num_pins == 2 and not session.fork_ids  # (1 in a run, 1 own)
    service.check_invariants()


@pytest.mark.parametrize("name", ["max_pins", "max_output_nbytes"])
@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_limits_must_be_positive_ints(name, value):
    with pytest.raises(BadArgsError, match=f"--{name.replace('_', '-')}"):
        Limits(**{name: value})
