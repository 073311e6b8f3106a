"""The remote tier with several pools and a model (issue 32): each pool's blocks under its own
keys, read through on lookup@POOL and on a model's seq_open under the hybrid prefix rule; the
`[remote]` table of --config; a lookup's reply telling local from remote blocks."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pytest

from kvd.cli import _pools, build_parser
from kvd.errors import BadArgsError
from kvd.geometry import Geometry
from kvd.hashing import hash_blocks
from kvd.runtime import DaemonPaths
from kvd.server.config import read_config
from kvd.server.startup import DaemonConfig
from redis_servers import redis_server  # noqa: F401 (a fixture)
from test_cli import kvd_cli
from test_metrics import scrape
from test_remote import BLOCK, block_bytes, prompt, redis_empty, wait_for  # noqa: F401

pytestmark = pytest.mark.integration
SHAPE = "layers=2,kv-heads=2,head-dim=8,dtype=float32,block-size=4"
DRAFT = "layers=1,kv-heads=2,head-dim=16,dtype=float32,block-size=4"
WINDOW = 10  # a hit needs the ceil(9 / 4) = 3 window blocks before the hit point
MEMORY = 512 * 1024
TAGS = {"full": 1, "sliding": 2, "draft": 3}  # distinct bytes per pool


def toml_config(tmp_path: Path, remote: str) -> Path:
    path = tmp_path / "kvd.toml"
    pools = "".join(f"[pools.{name}]\n" + "".join(
        f"{key} = {value if key != 'dtype' else repr(value)}\n"
        for key, value in (item.split("=") for item in shape.split(",")))
        for name, shape in (("full", SHAPE), ("sliding", f"{SHAPE},window={WINDOW}"),
                            ("draft", DRAFT)))
    path.write_text(f'memory = {MEMORY}\n{pools}[models.hybrid]\npools = ["full", "sliding"]\n'
                    f'{remote}')
    return path


def fill(client, pool: str, block_id: int, index: int) -> None:
    view = client.view(block_id, pool=pool)
    view[:] = block_bytes(TAGS[pool], index, view.shape)


def holds(client, pool: str, block_id: int, index: int) -> bool:
    """Whether the block holds A's bytes of block `index` of the pool (views die here: the
    client's segment closes only without any)."""
    view = client.view(block_id, pool=pool)
    return np.array_equal(view, block_bytes(TAGS[pool], index, view.shape))


def pool_remote(client, pool: str) -> dict:
    return client.stats()["pools"][pool]["remote"]


def flags_host(daemon_factory, url: str, **options):
    """A host of the same pools and model as `toml_config`'s, from the flags."""
    return daemon_factory(["--pool", f"full:{SHAPE}", "--pool",
                           f"sliding:{SHAPE},window={WINDOW}", "--pool", f"draft:{DRAFT}",
                           "--model", "hybrid:full,sliding"], memory=MEMORY, remote=url,
                          remote_timeout_ms=2000, **options)


def test_two_hosts_share_each_pool_and_a_model_under_the_hybrid_rule(daemon_factory, tmp_path,
                                                                      redis_empty):
    # host A from a TOML file with [remote], host B from the flags: the same pools
    config = toml_config(tmp_path, f'[remote]\nurl = "{redis_empty.url}"\ntimeout_ms = 2000\n')
    host_a = daemon_factory(config=str(config))
    host_b = flags_host(daemon_factory, redis_empty.url, metrics_port=0)
    with host_a.connect() as a, host_b.connect() as b:
        assert a.stats()["remote"]["timeout_ms"] == 2000
        # A prefills a model sequence of 6 blocks (distinct bytes per pool and block) and a raw
        # chain of 4 blocks in the draft pool
        tokens = prompt(1, 6)
        seq = a.open_model_sequence("hybrid", tokens + [7])
        for pool, table in seq.block_ids.items():
            for index, block_id in enumerate(table[:6]):
                fill(a, pool, block_id, index)
        a.commit_model_sequence(seq, 6 * BLOCK)  # (the window pool releases blocks 0-2)
        a.close_model_sequence(seq)
        draft = hash_blocks(prompt(3, 4), BLOCK)
        ids = a.alloc(4, pool="draft")
        for index, block_id in enumerate(ids):
            fill(a, "draft", block_id, index)
        a.seal(ids, draft, [None, *draft[:-1]], pool="draft")
        a.release(ids, pool="draft")
        wait_for(lambda: [pool_remote(a, p)["written"] for p in TAGS] == [6, 6, 4]
                 and a.stats()["remote"]["queue_depth"] == 0, "A's blocks written")

        # keys of two pools never meet: one hash chain, a key per pool, each its own bytes
        keys = redis_empty.cli("--scan", "--pattern", "kvd:*").split()
        by_pool = {pool: {key.rsplit(":", 1)[1] for key in keys if key.startswith(f"kvd:{pool}:")}
                   for pool in TAGS}
        assert by_pool["full"] == by_pool["sliding"] and len(by_pool["full"]) == 6
        assert len(keys) == 16 and not by_pool["draft"] & by_pool["full"]

        # B opens the prompt plus two more blocks (the next turn): the tier has the first 6
        # blocks of each pool; the hit is 6, its full pool holding all, its window pool the
        # window before the hit point, each byte-identical to A's
        opened = b.open_model_sequence("hybrid", tokens + prompt(9, 2) + [5])
        assert opened.num_cached_tokens == 6 * BLOCK
        assert opened.num_remote_tokens == 6 * BLOCK
        held = opened.block_ids["sliding"][:6]
        assert held[:3] == [-1, -1, -1] and -1 not in held[3:]
        for pool, table in opened.block_ids.items():
            for index, block_id in enumerate(table[:6]):
                assert block_id == -1 or holds(b, pool, block_id, index), (pool, index)
        b.close_model_sequence(opened)
        # only what the hit needed was imported: all 6 full blocks, the window's 3
        assert [pool_remote(b, p)["hit_blocks"] for p in ("full", "sliding")] == [6, 3]
        assert b.stats()["remote"]["hit_blocks"] == 9  # (the daemon's: every pool's summed)
        again = b.open_model_sequence("hybrid", tokens + [5])  # now local
        assert (again.num_cached_tokens, again.num_remote_tokens) == (6 * BLOCK, 0)
        b.close_model_sequence(again)

        # lookup@draft reads through its own pool only; its reply tells remote from local
        head = b.lookup(draft[:2], pool="draft")
        assert (len(head), head.num_remote) == (2, 2)
        whole = b.lookup(draft, pool="draft")
        assert whole[:2] == head and (len(whole), whole.num_remote) == (4, 2)
        assert all(holds(b, "draft", block_id, index) for index, block_id in enumerate(whole))
        b.release([*head, *whole], pool="draft")
        # the full pool's keys are not the draft pool's: nothing to fetch under its name
        assert b.lookup(hash_blocks(tokens, BLOCK), pool="draft") == []
        # an old client's lookup (no `remote` argument) still gets a plain list
        assert b._call("lookup@draft", {"hashes": draft}) == whole
        b.release(whole, pool="draft")

        metrics = scrape(b.stats()["metrics_port"])
        for pool, hits in (("full", 6), ("sliding", 3), ("draft", 4)):
            assert metrics[("kvd_remote_hit_blocks_total", (("pool", pool),))] == hits
            assert metrics[("kvd_remote_up", (("pool", pool),))] == 1
        text = kvd_cli("stats", "--name", host_b.name).stdout
        assert re.search(r"remote hit blocks \(of prefix hits\) +13 of \d+ ", text), text
        assert re.search(r"pool sliding: remote hit blocks +3 of 6 \(local 3\)", text), text

        # a gap in the window pool's blocks bounds the hit: without block 4 of the sliding pool
        # in the tier, host C's hit is 4 blocks (full 0-3, the window's 1-3), imported alone
        sliding = pool_remote(a, "sliding")["key_prefix"] + hash_blocks(tokens, BLOCK)[4].hex()
        assert redis_empty.cli("DEL", sliding) == "1"
        host_c = flags_host(daemon_factory, redis_empty.url)
        with host_c.connect() as c:
            opened = c.open_model_sequence("hybrid", tokens + [5])
            assert (opened.num_cached_tokens, opened.num_remote_tokens) == (4 * BLOCK,
                                                                            4 * BLOCK)
            for pool, table in opened.block_ids.items():
                for index, block_id in enumerate(table[:4]):
                    assert block_id == -1 or holds(c, pool, block_id, index), (pool, index)
            c.close_model_sequence(opened)
            assert [pool_remote(c, p)["hit_blocks"] for p in ("full", "sliding")] == [4, 3]
            assert not c.stats()["errors"]
        assert not a.stats()["errors"] and not b.stats()["errors"]


def start_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["start", *argv])


def test_remote_table_in_the_config_and_its_precedence(tmp_path):
    path = toml_config(tmp_path, '[remote]\nurl = "redis://10.0.0.1:7000"\ntimeout_ms = 40\n')
    assert read_config(path)["remote"] == {"url": "redis://10.0.0.1:7000", "timeout_ms": 40}
    *_, remote = _pools(start_args("--config", str(path)))
    assert remote == {"remote": "redis://10.0.0.1:7000", "remote_timeout_ms": 40}
    # the flags win, each on its own
    *_, remote = _pools(start_args("--config", str(path), "--remote", "redis://h:1",
                                   "--remote-timeout-ms", "7"))
    assert remote == {"remote": "redis://h:1", "remote_timeout_ms": 7}
    *_, remote = _pools(start_args("--config", str(path), "--remote-timeout-ms", "7"))
    assert remote == {"remote": "redis://10.0.0.1:7000", "remote_timeout_ms": 7}
    assert _pools(start_args())[-1] == {"remote": None}


@pytest.mark.parametrize("table, error", [
    ('[remote]\nurl = "redis://h:1"\ntimeot_ms = 4\n', r"unknown keys \['timeot_ms'\]; valid: "
                                                       "url, timeout_ms"),
    ('[remote]\ntimeout_ms = "4"\n', r"timeout_ms \(as --remote-timeout-ms\) must be a int"),
    ('remote = "redis://h:1"\n', r"write the remote tier as a table \[remote\]"),
])
def test_a_bad_remote_table_is_a_typed_error(tmp_path, table, error):
    path = tmp_path / "kvd.toml"
    path.write_text(table)
    with pytest.raises(BadArgsError, match=error):
        read_config(path)


def test_bad_remote_combinations_are_typed_errors(tmp_path):
    path = toml_config(tmp_path, "[remote]\ntimeout_ms = 40\n")
    with pytest.raises(BadArgsError, match=r"needs --remote \(or \[remote\] url"):
        _pools(start_args("--config", str(path)))
    with pytest.raises(BadArgsError, match=r"needs --remote"):
        _pools(start_args("--remote-timeout-ms", "5"))
    # a pool whose blocks no Redis value holds
    huge = Geometry(num_blocks=1, num_layers=512, block_size=1024, num_kv_heads=8, head_dim=128)
    with pytest.raises(BadArgsError, match="pool 'default': its .* blocks do not fit a Redis "
                                           "value"):
        DaemonConfig(DaemonPaths.for_name("remote-huge"), huge, remote="redis://127.0.0.1:1")


def test_without_a_tier_lookup_replies_stay_plain(kvd_daemon):
    with kvd_daemon.connect() as client:
        assert client.info["remote"] is False
        found = client.lookup([b"k" * 16])
        assert found == [] and found.num_remote == 0
        with pytest.raises(BadArgsError, match=r"unknown arguments \['remote'\]"):
            client._call("lookup", {"hashes": [b"k" * 16], "remote": 1})
