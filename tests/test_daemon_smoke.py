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
