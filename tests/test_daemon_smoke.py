import numpy as np

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
