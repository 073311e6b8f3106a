"""The fetch thread's reader of MGET replies (kvd/server/remote/tier.py's ReplyReader) on a socket
pair: RESP2 and RESP3 nulls, values split across reads anyhow, error replies and a closed socket
raise redis-py's errors (the tier then marks itself down and drops the connection)."""

from __future__ import annotations

import socket
import threading

import pytest

redis_exceptions = pytest.importorskip("redis.exceptions")

from kvd.server.remote.tier import ReplyReader  # noqa: E402

REPLIES = (b"*4\r\n$3\r\nabc\r\n$-1\r\n_\r\n$5\r\nhe\r\nl\r\n"
           + b"*1\r\n$9000\r\n" + bytes(range(256)) * 35 + b"x" * 40 + b"\r\n")


def read_two(chunks: list[bytes]) -> list[list[bytes | None]]:
    reader_end, writer_end = socket.socketpair()
    with reader_end, writer_end:
        def send() -> None:
            for chunk in chunks:
                writer_end.sendall(chunk)
        sender = threading.Thread(target=send)
        sender.start()
        reader = ReplyReader(reader_end)
        got = [[None if value is None else bytes(value) for value in reader.bulk_array()]
               for _ in range(2)]
        sender.join()
    return got


@pytest.mark.parametrize("step", [1, 7, 4096, len(REPLIES)])
def test_replies_split_anyhow_read_the_same(step: int) -> None:
    chunks = [REPLIES[start:start + step] for start in range(0, len(REPLIES), step)]
    assert read_two(chunks) == [[b"abc", None, None, b"he\r\nl"],
                                [bytes(range(256)) * 35 + b"x" * 40]]


def test_an_error_reply_or_a_closed_socket_raises() -> None:
    with pytest.raises(redis_exceptions.ResponseError, match="LOADING"):
        read_two([b"-LOADING Redis is loading\r\n"])
    reader_end, writer_end = socket.socketpair()
    with reader_end:
        writer_end.sendall(b"*2\r\n$5\r\nab")
        writer_end.close()
        with pytest.raises(redis_exceptions.ConnectionError):
            ReplyReader(reader_end).bulk_array()
