"""The client library: a session with a kvd daemon plus zero-copy views of its segment.

Theory of operation
-------------------
`kvd.connect()` opens the Unix socket, says `hello` (protocol version; the daemon answers with
the geometry and the segment's name and uuid) and maps the segment read-write. From then on
requests carry only metadata — block ids, hashes, token ids — and KV bytes are written and read
in place through NumPy views of the mapping (`pool`, `view`), never through the socket.

The client is synchronous: one request in flight, its reply read before the call returns. That
keeps a call's cost at one round trip and needs no threads. A `Client` belongs to the process that
made it: in a forked child every call raises InUseError, because the child would otherwise share
the parent's session (and its pins) silently. Call `kvd.connect()` again in the child.

Views are built with `np.frombuffer` over the mapping, so `close()` raises InUseError while any
view is alive rather than leaving readers on unmapped memory; drop views before closing.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.errors import BadArgsError, DisconnectedError, InUseError
from kvd.geometry import Geometry
from kvd.hashing import token_bytes
from kvd.protocol import (
    PROTOCOL_VERSION, FrameDecoder, encode_request, parse_reply, unpack_body,
)
from kvd.runtime import resolve_socket
from kvd.segment import Segment

_RECV_NBYTES = 256 * 1024
_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _disown_after_fork() -> None:
    for client in list(_live_clients):
        client._is_forked = True


os.register_at_fork(after_in_child=_disown_after_fork)


@dataclass
class Sequence:
    """A daemon-side sequence: its block table grows in place as tokens are appended.

    `num_cached_tokens` tokens at the start were found in the cache when it was opened: their KV
    is already in the blocks, so prefill starts there.
    """

    seq_id: int
    block_ids: list[int]
    num_tokens: int
    num_cached_tokens: int = 0
    num_sealed_blocks: int = 0
    is_closed: bool = field(default=False, repr=False)


class Client:
    """One session with a daemon. Use as a context manager or call `close()`."""

    def __init__(self, socket_path: str, timeout_s: float | None = None) -> None:
        self.socket_path = socket_path
        self._sock: socket.socket | None = None
        self._segment: Segment | None = None
        self._pool: np.ndarray | None = None
        self._decoder = FrameDecoder()
        self._next_id = 1
        self._pid = os.getpid()
        self._is_forked = False
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout_s)
            try:
                self._sock.connect(socket_path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise DisconnectedError(f"no kvd daemon at {socket_path} ({exc.strerror}): "
                                        "start one with `kvd start`") from None
            self.info = self._call("hello", {"version": PROTOCOL_VERSION, "pid": os.getpid()})
            self.geometry = Geometry.from_dict(self.info["geometry"])
            self.session_id: int = self.info["session_id"]
            self._segment = Segment.attach(self.info["segment"])
            if self._segment.uuid != self.info["segment_uuid"]:
                raise DisconnectedError(f"segment {self.info['segment']} is not the one the "
                                        "daemon serves (it was replaced): reconnect")
        except BaseException:
            self._teardown()
            raise
        _live_clients.add(self)

    # ---- plumbing --------------------------------------------------------------------------
    def _call(self, op: str, args: dict[str, Any]) -> Any:
        if self._is_forked or os.getpid() != self._pid:
            raise InUseError(f"this kvd connection belongs to process {self._pid}: call "
                             "kvd.connect() in the child process instead of sharing it")
        if self._sock is None:
            raise DisconnectedError("the client is closed: call kvd.connect() again")
        request_id = self._next_id
        self._next_id += 1
        try:
            self._sock.sendall(encode_request(request_id, op, args))
            body = self._read_body()
        except OSError as exc:
            raise DisconnectedError(f"lost the kvd daemon at {self.socket_path}: {exc}") from None
        reply_id, result = parse_reply(unpack_body(body))
        if reply_id != request_id:
            raise DisconnectedError(f"reply {reply_id} does not answer request {request_id}: "
                                    "the session is out of step, reconnect")
        return result

    def _read_body(self) -> bytes:
        while True:
            data = self._sock.recv(_RECV_NBYTES)
            if not data:
                raise DisconnectedError(f"the kvd daemon at {self.socket_path} closed the "
                                        "connection")
            bodies = self._decoder.feed(data)
            if bodies:
                return bodies[0]  # one request in flight: at most one reply

    def _teardown(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._pool = None
        if self._segment is not None:
            segment, self._segment = self._segment, None
            segment.close()

    def close(self) -> None:
        """End the session (the daemon releases its pins) and unmap the segment.

        Raises InUseError if a view of the segment is still alive (the socket is closed anyway).
        """
        _live_clients.discard(self)
        self._teardown()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def is_closed(self) -> bool:
        return self._sock is None

    # ---- blocks --------------------------------------------------------------------------
    @property
    def pool(self) -> np.ndarray:
        """Every block: `(num_blocks, num_layers, 2, block_size, H, D)`, a view of shared memory."""
        if self._pool is None:
            if self._segment is None:
                raise DisconnectedError("the client is closed: call kvd.connect() again")
            self._pool = self._segment.pool
        return self._pool

    def view(self, block_id: int) -> np.ndarray:
        """One block `(num_layers, 2, block_size, H, D)`, a view into shared memory (no copy)."""
        if type(block_id) is not int and not isinstance(block_id, np.integer):
            raise BadArgsError(f"block_id must be an int, got {block_id!r}")
        return self.pool[block_id]

    def generation(self, block_id: int) -> int:
        """The block's generation counter; it changes whenever the block is freed and reused."""
        return int(self._segment.generations[block_id])

    def alloc(self, num_blocks: int) -> list[int]:
        """`num_blocks` writable blocks owned by this session. Raises NoSpaceError."""
        return self._call("alloc", {"num_blocks": num_blocks})

    def seal(self, block_ids: SequenceOf[int], hashes: SequenceOf[bytes]) -> list[bool]:
        """Publish filled blocks under content hashes; returns which ones entered the index."""
        return self._call("seal", {"block_ids": _ids(block_ids), "hashes": list(hashes)})

    def lookup(self, hashes: SequenceOf[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`, pinned for this session."""
        return self._call("lookup", {"hashes": list(hashes)})

    def pin(self, block_ids: SequenceOf[int]) -> None:
        """One more pin on each sealed block (to share it)."""
        self._call("pin", {"block_ids": _ids(block_ids)})

    def release(self, block_ids: SequenceOf[int]) -> None:
        """Drop one pin per block; unsealed blocks are freed, sealed ones stay cached."""
        self._call("release", {"block_ids": _ids(block_ids)})

    def stats(self) -> dict[str, Any]:
        return self._call("stats", {})

    def shutdown(self, keep: bool = False) -> None:
        """Ask the daemon to stop (keep=True keeps segment and journal for a restart)."""
        self._call("shutdown", {"keep": keep})

    # ---- sequences -------------------------------------------------------------------------
    def open_sequence(self, token_ids: Any, salt: bytes = b"",
                      max_cached_tokens: int | None = None) -> Sequence:
        """Open a sequence: reuse the longest cached prefix, allocate the rest (one round trip).

        At most `max_cached_tokens` (default: all but the last token, whose logits an engine
        needs) come from the cache; write KV for tokens `[num_cached_tokens, num_tokens)`.
        """
        args: dict[str, Any] = {"tokens": token_bytes(token_ids), "salt": salt}
        if max_cached_tokens is not None:
            args["max_cached_tokens"] = max_cached_tokens
        reply = self._call("seq_open", args)
        return Sequence(reply["seq_id"], reply["block_ids"], reply["num_tokens"],
                        reply["num_cached_tokens"], reply["num_sealed_blocks"])

    def extend_sequence(self, seq: Sequence, token_ids: Any,
                        num_computed: int | None = None) -> list[int]:
        """Append tokens, allocating blocks; first seal full blocks below `num_computed`
        (default: the tokens before this call). Returns the new block ids."""
        data = token_bytes(token_ids)
        num_computed = seq.num_tokens if num_computed is None else num_computed
        new_ids = self._call("seq_extend", {"seq_id": seq.seq_id, "tokens": data,
                                            "num_computed": num_computed})
        seq.block_ids.extend(new_ids)
        seq.num_tokens += len(data) // 4
        seq.num_sealed_blocks = max(seq.num_sealed_blocks,
                                    num_computed // self.geometry.block_size)
        return new_ids

    def commit_sequence(self, seq: Sequence, num_computed: int | None = None) -> int:
        """Seal the full blocks below `num_computed` tokens (default all); returns how many."""
        num_computed = seq.num_tokens if num_computed is None else num_computed
        num_sealed = self._call("seq_commit", {"seq_id": seq.seq_id,
                                               "num_computed": num_computed})
        seq.num_sealed_blocks += num_sealed
        return num_sealed

    def fork_sequence(self, seq: Sequence) -> Sequence:
        """A new sequence sharing `seq`'s sealed blocks; its unsealed blocks are copies."""
        reply = self._call("seq_fork", {"seq_id": seq.seq_id})
        return Sequence(reply["seq_id"], reply["block_ids"], reply["num_tokens"],
                        seq.num_cached_tokens, reply["num_sealed_blocks"])

    def close_sequence(self, seq: Sequence) -> None:
        """Release the sequence's blocks (sealed ones stay cached for others)."""
        self._call("seq_close", {"seq_id": seq.seq_id})
        seq.is_closed = True


def _ids(block_ids: SequenceOf[int]) -> list[int]:
    # msgpack cannot pack np.int64: accept NumPy ids from callers and send plain ints.
    return [int(block_id) for block_id in block_ids]


def connect(name_or_socket_path: str | None = None, timeout_s: float | None = None) -> Client:
    """Connect to a daemon by name (default `$KVD_NAME` or "default") or socket path."""
    return Client(resolve_socket(name_or_socket_path), timeout_s)
