"""The trace load generator against a real daemon, on a small generated trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.traces import Request, write_trace
from workers.loadgen import block_tokens, prompt_tokens

GEOMETRY = {"num_blocks": 24, "block_size": 16, "layers": 2, "kv_heads": 2, "head_dim": 16}


def _chat_trace(num_requests: int = 16) -> list[Request]:
    """Four conversations, each turn re-sending its history; block 0 is a shared system prompt."""
    requests, next_id = [], 1
    histories: list[list[int]] = [[0] for _ in range(4)]
    for i in range(num_requests):
        history = histories[i % 4]
        history += [next_id, next_id + 1]
        next_id += 2
        requests.append(Request(i * 100, 512 * len(history) - 100, 64, tuple(history)))
    return requests


def _loadgen(trace: Path, name: str, env: dict, root: Path, *extra: str) -> dict:
    command = [sys.executable, "-m", "workers.loadgen", str(trace), "--name", name,
               "--workers", "2", "--scale", "32", "--json", *extra]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_equal_hash_ids_give_equal_token_blocks() -> None:
    np.testing.assert_array_equal(block_tokens(7, 16, 512, 0), block_tokens(7, 16, 512, 0))
    assert not np.array_equal(block_tokens(7, 16, 512, 0), block_tokens(8, 16, 512, 0))
    a = prompt_tokens(Request(0, 1000, 1, (0, 1)), 32, 512, 0)
    b = prompt_tokens(Request(0, 1500, 1, (0, 1, 2)), 32, 512, 0)
    assert len(a) == 32 and len(b) == 47                # ceil(1000/32), ceil(1500/32)
    np.testing.assert_array_equal(a, b[:32])


@pytest.mark.integration
@pytest.mark.parametrize("mode", [[], ["--no-model"]], ids=["model", "kvd-only"])
def test_replay_reports_hits_and_evictions(daemon_factory, worker_env: dict, source_root: Path,
                                           tmp_path: Path, mode: list[str]) -> None:
    trace = tmp_path / "chat.jsonl"
    write_trace(trace, _chat_trace())
    name = daemon_factory(**GEOMETRY, dtype="float32").name
    summary = _loadgen(trace, name, worker_env, source_root, *mode)
    assert summary["requests"] == 16 and summary["rejected"] == 0
    assert summary["workers"] == 2
    assert summary["requests_per_s"] > 0
    # Every turn after a conversation's first re-sends its history: most prompt tokens hit.
    assert 0.3 < summary["prefix_hit_ratio"] < 1.0
    # 33 distinct full blocks (block 0 + 4 conversations x 8) do not fit in 24: old ones go.
    assert summary["evictions"] > 0


def test_absent_trace_skips_with_a_message(worker_env: dict, source_root: Path,
                                           tmp_path: Path) -> None:
    absent = tmp_path / "no" / "t.jsonl"
    done = subprocess.run([sys.executable, "-m", "workers.loadgen", str(absent)], env=worker_env,
                          cwd=source_root, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    assert "skipped" in done.stderr and "absent" in done.stderr


@pytest.mark.integration
def test_replay_of_the_real_trace_head(daemon_factory, shared_traces: Path, worker_env: dict,
                                       source_root: Path) -> None:
    """The first requests of the Mooncake trace (skips when ../shared/traces is absent)."""
    name = daemon_factory(**{**GEOMETRY, "num_blocks": 1024}, dtype="float32").name
    summary = _loadgen(shared_traces / "synthetic_trace.jsonl", name, worker_env, source_root,
                       "--limit", "60", "--no-model")
    assert summary["requests"] + summary["rejected"] == 60
    assert summary["requests"] > 0
