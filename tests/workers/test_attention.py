"""Attention workers in real processes with their KV in a real daemon, against the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.geometry import Geometry
from workers.attention import config_for_geometry, conversations, run_conversation
from workers.model import ContiguousKV, DecoderLM

pytestmark = pytest.mark.integration

GEOMETRY = {"num_blocks": 64, "block_size": 16, "layers": 2, "kv_heads": 2, "head_dim": 16}
WORKLOAD = {"system_prompts": 1, "system_tokens": 64, "conversations": 1, "turns": 2,
            "user_tokens": 20, "new_tokens": 8}


def _run_worker(name: str, worker_id: int, logits_path: Path, env: dict, root: Path) -> dict:
    command = [sys.executable, "-m", "workers.attention", "--name", name, "--json",
               "--worker-id", str(worker_id), "--num-workers", "2",
               "--save-logits", str(logits_path)]
    for key, value in WORKLOAD.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _reference_logits(worker_id: int, dtype: str) -> np.ndarray:
    geometry = Geometry(num_blocks=1, num_layers=GEOMETRY["layers"],
                        block_size=GEOMETRY["block_size"], num_kv_heads=GEOMETRY["kv_heads"],
                        head_dim=GEOMETRY["head_dim"], dtype=dtype)
    model = DecoderLM(config_for_geometry(geometry))
    workload = conversations(worker_id, 2, WORKLOAD["conversations"], WORKLOAD["turns"],
                             WORKLOAD["system_prompts"], WORKLOAD["system_tokens"],
                             WORKLOAD["user_tokens"])

    def generate(prompt: np.ndarray, n: int) -> tuple[list[int], list[np.ndarray]]:
        return model.generate(prompt, n, ContiguousKV(model.config, len(prompt) + n,
                                                      geometry.numpy_dtype))

    return np.stack([np.stack(step_logits) for conversation in workload
                     for step_logits in run_conversation(generate, conversation,
                                                         WORKLOAD["new_tokens"])])


# The workers prefill past their cached prefix, the reference every prompt whole: different
# matmul shapes, so float32 sums round differently (~1e-7), and in a float16 store that flips
# some K/V values by one ulp (~1e-3 of the value). Two orders of the reference itself then
# differ by ~3e-5 in the logits (numpy 2.4.6's BLAS); one token's K/V taken from the wrong block
# moved them by 0.4 when tried.
LOGITS_TOLERANCE = {"float32": 1e-5, "float16": 2e-4}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_second_worker_reuses_shared_prefix_and_matches_reference(
        daemon_factory, worker_env: dict, source_root: Path, tmp_path: Path, dtype: str) -> None:
    name = daemon_factory(**GEOMETRY, dtype=dtype).name
    first = _run_worker(name, 0, tmp_path / "w0.npy", worker_env, source_root)
    second = _run_worker(name, 1, tmp_path / "w1.npy", worker_env, source_root)

    # Turn 2 re-sends turn 1's prompt and reply: 64 + 20 + 7 computed tokens = 5 sealed blocks.
    history_hit = 5 * 16
    assert first["cached_tokens"] == history_hit                  # nothing cached at turn 1
    assert second["cached_tokens"] == WORKLOAD["system_tokens"] + history_hit
    assert first["prompt_tokens"] == second["prompt_tokens"] == 84 + 112

    for worker_id, path in ((0, "w0.npy"), (1, "w1.npy")):
        paged = np.load(tmp_path / path)
        reference = _reference_logits(worker_id, dtype)
        assert paged.shape == reference.shape == (2, WORKLOAD["new_tokens"], 512)
        assert np.abs(paged - reference).max() <= LOGITS_TOLERANCE[dtype]


def test_worker_reports_no_space_not_a_masking_close_error(daemon_factory, worker_env: dict,
                                                           source_root: Path) -> None:
    name = daemon_factory(**{**GEOMETRY, "num_blocks": 4}, dtype="float32").name
    done = subprocess.run([sys.executable, "-m", "workers.attention", "--name", name,
                           "--system-tokens", "100"], env=worker_env, cwd=source_root,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "NoSpaceError" in done.stderr and "InUseError" not in done.stderr, done.stderr
