import numpy as np
import pytest

import kvd


def test_two_clients_share_a_sealed_block(kvd_daemon):
    hashes = kvd.hash_blocks(np.arange(8), 4)
    with kvd_daemon.connect() as writer, kvd_daemon.connect() as reader:
        block_ids = writer.alloc(2)
        for i, block_id in enumerate(block_ids):
            writer.view(block_id)[:] = i + 1
        writer.seal(block_ids, hashes)
        assert reader.lookup(hashes) == block_ids
        assert (reader.pool[block_ids[1]] == 2).all()


def test_with_block_lets_the_real_error_through_while_views_live(kvd_daemon):
    with pytest.raises(kvd.NoSpaceError):
        with kvd_daemon.connect() as client:
            view = client.view(0)  # a live view while the error passes through __exit__
            client.alloc(client.geometry.num_blocks + 0)
            client.alloc(1)
    del view
    with kvd_daemon.connect() as client:  # the failed session's blocks were released
        assert len(client.alloc(client.geometry.num_blocks)) == client.geometry.num_blocks


def test_shutdown_before_hello_is_a_protocol_error(kvd_daemon):
    import socket

    from kvd.protocol import FrameDecoder, encode_request, parse_reply, unpack_body

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(kvd_daemon.paths.socket_path)
        sock.sendall(encode_request(1, "shutdown", {}))
        decoder = FrameDecoder()
        bodies = []
        while not bodies:
            bodies = decoder.feed(sock.recv(4096))
        with pytest.raises(kvd.ProtocolError):
            parse_reply(unpack_body(bodies[0]))
    with kvd_daemon.connect() as client:  # still serving
        assert client.stats()["requests"]["shutdown"] == 1
