"""Hashing: kvd.hash_blocks cost per token against a SHA-256 chain like vLLM's prefix cache.

The baseline is written here from the published description of vLLM's scheme, not its code: block
i's hash is SHA-256 over the pickled tuple (parent hash, tuple of the block's token ids, extra
keys), chained from a fixed root. Pickle appears only in this baseline, never in kvd.
Both run in the same process on the same prompts (random token ids below 128k, as a Python list,
which is what a caller usually holds); kvd is also timed on a NumPy int32 array. Best of repeats.

    python -m bench.hashing [--quick] [--out DIR]
"""

from __future__ import annotations

import hashlib
import pickle
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kvd
from bench.common import bench_main, best_seconds, markdown_table, progress, write_json

BLOCK_SIZES = (16, 512)
PROMPT_TOKENS = (4096, 131072)
BASELINE_ROOT = hashlib.sha256(b"baseline-root").digest()


def sha256_pickle_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """The baseline: SHA-256 of pickle((parent, tuple(block tokens), None)), chained."""
    parent, hashes = BASELINE_ROOT, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start:start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        hashes.append(parent)
    return hashes


def measure(block_size: int, num_tokens: int, budget_s: float) -> dict[str, Any]:
    rng = random.Random(num_tokens * 1000 + block_size)
    tokens = [rng.randrange(128_000) for _ in range(num_tokens)]
    array = np.array(tokens, dtype=np.int32)
    num_blocks = len(kvd.hash_blocks(tokens, block_size))
    if num_blocks != len(sha256_pickle_chain(tokens, block_size)):
        raise RuntimeError("baseline and kvd disagree on the number of full blocks")

    def ns_per_token(hash_fn: Callable[[], Any]) -> float:
        return best_seconds(hash_fn, repeats=3, min_time_s=budget_s) * 1e9 / num_tokens
    row = {"block_size": block_size, "prompt_tokens": num_tokens, "num_blocks": num_blocks,
           "kvd_list_ns_per_token": ns_per_token(lambda: kvd.hash_blocks(tokens, block_size)),
           "kvd_numpy_ns_per_token": ns_per_token(lambda: kvd.hash_blocks(array, block_size)),
           "sha256_pickle_ns_per_token": ns_per_token(
               lambda: sha256_pickle_chain(tokens, block_size))}
    row["baseline_over_kvd_list"] = row["sha256_pickle_ns_per_token"] / row["kvd_list_ns_per_token"]
    return row


def run_bench(quick: bool, out: Path) -> str:
    """Quick: 4k-token prompts, 3 repeats each; full: half a second of repeats each."""
    rows = []
    for block_size in BLOCK_SIZES:
        for num_tokens in PROMPT_TOKENS[:1] if quick else PROMPT_TOKENS:
            progress(f"hashing: block {block_size}, {num_tokens} tokens")
            rows.append(measure(block_size, num_tokens, 0.0 if quick else 0.5))
    write_json(out, "hashing", {"hash_version": kvd.HASH_VERSION,
                                "python": sys.version.split()[0], "rows": rows})
    table = markdown_table(
        ["block", "prompt tokens", "kvd list ns/token", "kvd numpy ns/token",
         "sha256+pickle ns/token", "sha256 / kvd (list)"],
        [[r["block_size"], r["prompt_tokens"], f"{r['kvd_list_ns_per_token']:.1f}",
          f"{r['kvd_numpy_ns_per_token']:.1f}", f"{r['sha256_pickle_ns_per_token']:.1f}",
          f"{r['baseline_over_kvd_list']:.2f}x"] for r in rows])
    return "## Hashing: kvd.hash_blocks vs a SHA-256/pickle chain (bench/hashing.py)\n\n" + table


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
