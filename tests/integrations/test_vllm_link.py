"""The vLLM connector's connection to its daemon (kvd/integrations/vllm/link.py): optional,
logged once, taken up when the daemon comes, refused when its pool does not fit."""

from __future__ import annotations

import time

import pytest

import kvd
from conftest import DaemonHandle, daemon_name, start_daemon_process
from kvd.errors import BadArgsError, NotFoundError
from kvd.geometry import Geometry
from kvd.integrations.vllm import link as link_module
from kvd.integrations.vllm.link import DaemonLink, check_fits
from kvd.runtime import DaemonPaths

SHAPE = {"layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
WANTED = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}


def start(name, tmp_path) -> DaemonHandle:
    log_path = tmp_path / f"{name}.log"
    handle = DaemonHandle(name, start_daemon_process(name, log_path, num_blocks=32, **SHAPE),
                          DaemonPaths.for_name(name), log_path)
    handle.wait_ready()
    return handle


def new_link(name, lines, retry_s=0.05) -> DaemonLink:
    link_module._logged.pop(name, None)
    return DaemonLink(name, None, lambda geometry: check_fits(WANTED, geometry), lines.append,
                      retry_s=retry_s)


def test_a_missing_daemon_is_logged_once_and_taken_up_when_it_comes(tmp_path):
    name, lines = daemon_name(), []
    link, other = new_link(name, lines), DaemonLink(name, None, lambda g: None, lines.append)
    assert not link.start() and not other.start()  # the scheduler's and the worker's links
    assert link.lookup([b"x" * 16]) == ([], None)
    assert len(lines) == 1 and "runs without the kvd cache" in lines[0], lines
    daemon = start(name, tmp_path)
    try:
        time.sleep(0.1)
        assert link.client() is not None
        assert "in use again" in lines[-1]
        link.close()
    finally:
        daemon.stop_and_check()


def test_a_clean_restart_costs_no_lookup_and_drops_the_old_sessions_pins(tmp_path):
    name, lines = daemon_name(), []
    daemon = start(name, tmp_path)
    link = new_link(name, lines)
    try:
        assert link.start()
        with kvd.connect(name) as client:
            block_ids = client.alloc(1)
            digest = kvd.hash_blocks([1, 2, 3, 4], 4)
            client.seal(block_ids, digest)
            client.release(block_ids)
        found, session = link.lookup(digest)
        assert found == block_ids
        daemon.stop_and_check()
        daemon = start(name, tmp_path)  # a clean start: a new, empty segment
        assert link.lookup(digest) == ([], link.session())  # answered by the new daemon
        assert session != link.session()
        link.release(found, session)  # pins of the old session: nothing is sent
        with kvd.connect(name) as client:
            assert client.stats()["requests"].get("release", 0) == 0
        link.close()
    finally:
        daemon.stop_and_check()


def test_a_daemon_whose_pool_does_not_fit_is_refused_naming_the_flags(daemon_factory):
    daemon = daemon_factory(num_blocks=32, **dict(SHAPE, block_size=16))
    with pytest.raises(BadArgsError, match="block_size 4 \\(pool 16\\).*--block-size 4"):
        new_link(daemon.name, []).start()
    with pytest.raises(BadArgsError, match="dtype float16 \\(pool float32\\)"):
        check_fits(dict(WANTED, dtype="float16"), Geometry(num_blocks=1, **WANTED))


def test_the_link_takes_the_pool_it_names_and_refuses_one_the_daemon_lacks(daemon_factory):
    daemon = daemon_factory(["--pool", "draft:layers=2,kv-heads=2,head-dim=8,dtype=float32,"
                             "block-size=4", "--pool", "other:layers=1,kv-heads=1,head-dim=8,"
                             "dtype=float32,block-size=4"], memory=256 * 1024)
    link = DaemonLink(daemon.name, "draft", lambda g: check_fits(WANTED, g), print)
    try:
        assert link.start()
        client = link.client()
        assert client is not None and client.info["pool"] == "draft"
    finally:
        link.drop()
    with pytest.raises(NotFoundError, match="no pool 'big': this daemon serves draft, other"):
        DaemonLink(daemon.name, "big", lambda g: None, print).start()
