"""kvd.Client against a real daemon: metadata-only frames, fork safety, sequences, view lifetime.

The frame-size test puts a relay of our own between the client and the daemon's socket and
counts every byte that crosses it while megabytes of KV are written, sealed and looked up.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

import numpy as np
import pytest

import kvd
import kvd.client as client_module
from kvd.protocol import encode_error

pytestmark = pytest.mark.integration

STATE_KEYS = ("free", "owned", "sealed", "cached", "indexed", "allocations", "evictions",
              "seals", "sequences")


def state(client: kvd.Client) -> tuple:
    stats = client.stats()
    return tuple(stats[key] for key in STATE_KEYS)


class CountingRelay:
    """A Unix socket at `path` relaying connections to `target` and counting their bytes."""

    def __init__(self, target: str, path: str, num_connections: int) -> None:
        self.nbytes = {"to_daemon": 0, "from_daemon": 0}
        self._target = target
        self._sockets: list[socket.socket] = []
        self._pumps: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(num_connections)
        self._acceptor = threading.Thread(target=self._accept, args=(num_connections,))
        self._acceptor.start()

    def _accept(self, num_connections: int) -> None:
        for _ in range(num_connections):
            downstream, _ = self._listener.accept()
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self._target)
            self._sockets += [downstream, upstream]
            for src, dst, key in ((downstream, upstream, "to_daemon"),
                                  (upstream, downstream, "from_daemon")):
                pump = threading.Thread(target=self._pump, args=(src, dst, key))
                pump.start()
                self._pumps.append(pump)

    def _pump(self, src: socket.socket, dst: socket.socket, key: str) -> None:
        try:
            while data := src.recv(1 << 16):
                self.nbytes[key] += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the other side is gone: nothing left to relay

    def close(self) -> None:
        self._acceptor.join(10)
        for pump in self._pumps:
            pump.join(10)
        for sock in (*self._sockets, self._listener):
            sock.close()


def test_frames_carry_metadata_only_never_kv_bytes(daemon_factory, tmp_path):
    # Default block shape (8 layers, 2, 16 tokens, 8 heads, 128 dims) in float16: 512 KiB a block.
    daemon = daemon_factory(num_blocks=16)
    relay = CountingRelay(daemon.paths.socket_path, str(tmp_path / "relay.sock"), 2)
    hashes = kvd.hash_blocks(np.arange(8 * 16), 16)
    try:
        with kvd.connect(str(tmp_path / "relay.sock")) as writer, \
                kvd.connect(str(tmp_path / "relay.sock")) as reader:
            block_nbytes = writer.geometry.block_nbytes
            assert block_nbytes == 512 * 1024
            block_ids = writer.alloc(8)
            data = np.random.default_rng(0).standard_normal(
                (8, *writer.geometry.block_shape)).astype(np.float16)
            writer.pool[block_ids] = data
            writer.seal(block_ids, hashes)
            found = reader.lookup(hashes)
            assert found == block_ids
            assert np.array_equal(reader.pool[found], data)
            reader.release(found)
            writer.release(block_ids)
    finally:
        relay.close()
    kv_nbytes = 8 * block_nbytes  # 4 MiB written and read
    socket_nbytes = relay.nbytes["to_daemon"] + relay.nbytes["from_daemon"]
    # Two hellos (the reply carries geometry and names) plus four requests: about 1 KiB.
    assert socket_nbytes < 2048, relay.nbytes
    assert socket_nbytes < kv_nbytes / 1000


def test_a_forked_child_cannot_reuse_its_parents_connection(kvd_daemon):
    with kvd_daemon.connect() as client:
        block_ids = client.alloc(1)
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            status = 1
            try:
                try:
                    client.alloc(1)
                except kvd.InUseError:
                    with kvd_daemon.connect() as own:  # its own session works
                        own.release(own.alloc(1))
                        status = 0
                client.close()  # (closes the child's copy only: no shutdown of the socket)
            finally:
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(wait_status) == 0
        stats = client.stats()  # the parent's session is untouched by the child's exit
        assert (stats["owned"], client.pool is not None) == (1, True)
        client.release(block_ids)


def _write_tokens(client: kvd.Client, seq: kvd.Sequence, start: int, stop: int) -> None:
    """Fake KV: every value of token t's slot is t."""
    block_size = client.geometry.block_size
    for t in range(start, stop):
        client.view(seq.block_ids[t // block_size])[:, :, t % block_size] = t


def test_sequence_lifecycle_fork_and_prefix_reuse_across_clients(kvd_daemon):
    with kvd_daemon.connect() as a, kvd_daemon.connect() as b:
        seq = a.open_sequence(np.arange(10))
        assert (seq.num_tokens, seq.num_cached_tokens, len(seq.block_ids)) == (10, 0, 3)
        _write_tokens(a, seq, 0, 10)
        new_ids = a.extend_sequence(seq, [10, 11, 12])  # seals blocks 0, 1 (tokens 0-7)
        assert len(new_ids) == 1 and seq.block_ids[3] == new_ids[0]
        assert (seq.num_tokens, seq.num_sealed_blocks) == (13, 2)
        _write_tokens(a, seq, 10, 13)
        assert a.commit_sequence(seq) == 1  # block 2 (tokens 8-11) is full now
        child = a.fork_sequence(seq)
        assert child.block_ids[:3] == seq.block_ids[:3]  # sealed: shared
        assert child.block_ids[3] != seq.block_ids[3]  # unsealed: copied
        assert np.array_equal(a.view(child.block_ids[3]), a.view(seq.block_ids[3]))
        a.view(child.block_ids[3])[:] = -1  # the copy is private to the child
        assert a.view(seq.block_ids[3])[0, 0, 0, 0, 0] == 12
        a.close_sequence(seq)
        a.close_sequence(child)
        assert seq.is_closed

        reused = b.open_sequence(np.arange(13))
        assert reused.num_cached_tokens == 12 and reused.block_ids[:3] == seq.block_ids[:3]
        cached_kv = b.pool[reused.block_ids[:3]]
        assert all((cached_kv[:, :, :, slot] == np.arange(12).reshape(3, 4)[:, slot]
                    .reshape(3, 1, 1, 1, 1)).all() for slot in range(4))
        b.close_sequence(reused)
        capped = b.open_sequence(np.arange(13), max_cached_tokens=5)
        assert capped.num_cached_tokens == 4 and capped.block_ids[0] == seq.block_ids[0]
        b.close_sequence(capped)
        salted = b.open_sequence(np.arange(13), salt=b"tenant-b")
        assert salted.num_cached_tokens == 0
        b.close_sequence(salted)
        stats = b.stats()
        assert (stats["prompt_tokens"], stats["cached_tokens"]) == (10 + 13 * 3, 12 + 4)
        assert (stats["sequences"], stats["owned"], stats["sealed"]) == (0, 0, 0)


def test_no_space_on_open_leaves_nothing_pinned(kvd_daemon):
    with kvd_daemon.connect() as a, kvd_daemon.connect() as hog:
        seq = a.open_sequence(np.arange(9))
        a.commit_sequence(seq)
        a.close_sequence(seq)  # tokens 0-7 cached in 2 blocks
        stats = a.stats()
        held = hog.alloc(stats["free"] - 1)  # leaves 1 free + 2 cached
        before = state(a)
        with pytest.raises(kvd.NoSpaceError, match="need 3 blocks but only 1"):
            a.open_sequence(np.arange(20))  # 2 cached + 3 new
        assert state(a) == before
        assert a.stats()["cached"] == 2  # the prefix hits went back to the cache
        fits = a.open_sequence(np.arange(9))  # 2 cached + 1 new
        assert fits.num_cached_tokens == 8
        a.close_sequence(fits)
        hog.release(held)


def test_views_are_checked_and_keep_the_mapping_alive(kvd_daemon):
    with kvd_daemon.connect() as observer:
        client = kvd_daemon.connect()
        for bad in (-1, 64, "3", 1.0):
            with pytest.raises(kvd.BadArgsError):
                client.view(bad)
        block_ids = client.alloc(1)
        generation = client.generation(block_ids[0])
        client.release(block_ids)
        assert client.generation(block_ids[0]) == generation + 1  # freed: a stale id shows it
        view = client.view(np.int64(5))
        with pytest.raises(kvd.InUseError, match="views"):
            client.close()
        assert client.is_closed  # the session ended anyway...
        view[:] = 1.0  # ...and the view is still valid memory
        del view
        with pytest.raises(kvd.DisconnectedError, match="closed"):
            client.stats()
        stats = observer.stats()
        while stats["sessions"] > 1:
            stats = observer.stats()
        assert stats["owned"] == 0


def test_a_missing_or_stopped_daemon_is_a_disconnected_error(kvd_daemon):
    with pytest.raises(kvd.DisconnectedError, match="kvd start"):
        kvd.connect("t-no-such-daemon")
    with kvd_daemon.connect(reconnect_timeout_s=0.2) as client:
        kvd_daemon.proc.send_signal(signal.SIGTERM)
        assert kvd_daemon.proc.wait(20) == 0
        with pytest.raises(kvd.DisconnectedError, match="no daemon came back"):
            client.stats()
        assert client.is_closed  # given up: later calls say so without another wait


def test_bad_client_arguments_are_typed_errors_and_never_truncated(kvd_daemon):
    """Regression: `release([1.7])` released block 1 and `release(["0"])` block 0 (ids went
    through int()); `release(5)`, `lookup(None)` and `alloc(np.int64(1))` raised bare TypeErrors."""
    for bad in ({"timeout_s": -1}, {"timeout_s": 0}, {"timeout_s": "1"},
                {"reconnect_timeout_s": None}, {"reconnect_timeout_s": True}):
        with pytest.raises(kvd.BadArgsError, match=next(iter(bad))):
            kvd_daemon.connect(**bad)
    with pytest.raises(kvd.BadArgsError, match="name or a socket path"):
        kvd.connect(5)
    with kvd_daemon.connect() as client:
        block_ids = client.alloc(np.int64(2))  # NumPy integers are ints
        before = state(client)
        for bad_ids in ([1.7], ["0"], 5, [None], [block_ids[0], 2.0]):
            for call in (client.release, client.pin, lambda ids: client.seal(ids, [b"k" * 16])):
                with pytest.raises(kvd.BadArgsError, match="block_ids"):
                    call(bad_ids)
        with pytest.raises(kvd.BadArgsError, match="hashes"):
            client.lookup(None)
        with pytest.raises(kvd.BadArgsError, match="cannot be sent"):
            client.lookup([object()])
        with pytest.raises(kvd.BadArgsError, match="num_blocks"):
            client.alloc(1.0)
        with pytest.raises(kvd.BadArgsError, match="max_cached_tokens"):
            client.open_sequence([1, 2, 3], max_cached_tokens=1.5)
        assert state(client) == before  # nothing reached the daemon's state
        client.release(np.array(block_ids))


def test_a_refusal_sent_before_the_hello_is_the_error_raised_not_a_disconnect(tmp_path,
                                                                              monkeypatch):
    """A daemon refusing a connection (another uid) sends its error frame and closes at once;
    when that happens before the client's hello goes out, the send fails with EPIPE and the
    client must still raise the daemon's error (DeniedError), not DisconnectedError."""
    path = str(tmp_path / "kvd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    refused = threading.Event()

    def refuse() -> None:
        sock, _ = listener.accept()  # (of the patched class too: it must not use sendall)
        sock.send(encode_error(None, kvd.DeniedError("this daemon serves uid 0 only")))
        sock.close()
        refused.set()

    class SendsAfterTheRefusal(socket.socket):
        def sendall(self, data: bytes, *args: object) -> None:
            refused.wait(10)  # the worst order: the daemon is gone before the hello is sent
            super().sendall(data, *args)

    monkeypatch.setattr(client_module.socket, "socket", SendsAfterTheRefusal)
    thread = threading.Thread(target=refuse)
    thread.start()
    try:
        with pytest.raises(kvd.DeniedError, match="serves uid 0 only"):
            kvd.connect(path, reconnect_timeout_s=0)
    finally:
        thread.join(10)
        listener.close()


def test_raw_seals_with_parents_and_tiers_reach_the_prefix_tree(daemon_factory):
    daemon = daemon_factory(extra_args=["--tiers", "prefill=0.5,decode=0.5"], num_blocks=4)
    hashes = kvd.hash_blocks(np.arange(3 * 16), 16)
    with daemon.connect() as client:
        block_ids = client.alloc(3)
        assert client.seal(block_ids, hashes, parents=[None, *hashes[:2]],
                           tiers=np.array([0, 0, 1])) == [True] * 3
        client.release(block_ids[:1])  # the head becomes evictable first...
        client.release(block_ids[1:])
        stats = client.stats()
        assert stats["tier_blocks"] == {"prefill": 2, "decode": 1}
        client.release(client.alloc(4))  # ...a full pool's eviction takes the chain along
        assert client.lookup(hashes) == []
        assert client.stats()["evictions"] == 3
        with pytest.raises(kvd.BadArgsError, match="parents"):
            client.seal(client.alloc(1), hashes[:1], parents=[b""])


def test_a_read_only_client_reads_sealed_blocks_and_cannot_write_any(kvd_daemon):
    hashes = kvd.hash_blocks(np.arange(4), 4)
    with kvd_daemon.connect() as writer, kvd_daemon.connect(read_only=True) as reader:
        [block_id] = writer.alloc(1)
        writer.view(block_id)[:] = 7.0
        writer.seal([block_id], hashes)
        assert reader.lookup(hashes) == [block_id]
        view = reader.view(block_id)
        assert (view == 7.0).all() and not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[:] = 0.0  # a stray write raises instead of changing a sealed block
        with pytest.raises(ValueError):
            view.flags.writeable = True
        assert (writer.view(block_id) == 7.0).all()
        for op, args in (("alloc", (1,)), ("seal", ([block_id], hashes)),
                         ("open_sequence", (np.arange(5),))):
            with pytest.raises(kvd.DeniedError, match=f"{op} writes blocks.*read-only"):
                getattr(reader, op)(*args)
        del view
        reader.release([block_id])
        writer.release([block_id])
