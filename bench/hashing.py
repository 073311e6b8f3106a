"""Bench: kvd.hash_blocks cost per token against a SHA-256 chain like vLLM's prefix cache.

The baseline is written here from the published description of vLLM's scheme, not its code: block
i's hash is SHA-256 over the pickled tuple (parent hash, tuple of the block's token ids, extra
keys), chained from a fixed root. Pickle appears only in this baseline, never in kvd.
Both run in the same process on the same prompts (random token ids below 128k, as a Python list,
which is what a caller usually holds); kvd is also timed on a NumPy int32 array. Best of repeats.

    python -m bench.hashing [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import kvd
from bench.common import write_json

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


def best_ns_per_token(hash_fn: Callable[[], list[bytes]], num_tokens: int,
                      budget_s: float) -> float:
    """Best wall time of repeated calls (at least 3, until `budget_s` is spent) per token."""
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < 3 or spent < budget_s:
        start = time.perf_counter()
        hash_fn()
        elapsed = time.perf_counter() - start
        best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
    return best * 1e9 / num_tokens


def measure(block_size: int, num_tokens: int, budget_s: float) -> dict:
    rng = random.Random(num_tokens * 1000 + block_size)
    tokens = [rng.randrange(128_000) for _ in range(num_tokens)]
    array = np.array(tokens, dtype=np.int32)
    num_blocks = len(kvd.hash_blocks(tokens, block_size))
    if num_blocks != len(sha256_pickle_chain(tokens, block_size)):
        raise RuntimeError("baseline and kvd disagree on the number of full blocks")
    row = {
        "block_size": block_size, "prompt_tokens": num_tokens, "num_blocks": num_blocks,
        "kvd_list_ns_per_token": best_ns_per_token(
            lambda: kvd.hash_blocks(tokens, block_size), num_tokens, budget_s),
        "kvd_numpy_ns_per_token": best_ns_per_token(
            lambda: kvd.hash_blocks(array, block_size), num_tokens, budget_s),
        "sha256_pickle_ns_per_token": best_ns_per_token(
            lambda: sha256_pickle_chain(tokens, block_size), num_tokens, budget_s),
    }
    row["baseline_over_kvd_list"] = row["sha256_pickle_ns_per_token"] / row["kvd_list_ns_per_token"]
    return row


def print_table(rows: list[dict]) -> None:
    print("\nhash_blocks vs a SHA-256/pickle chain (ns per token, lower is better)")
    print(f"{'block':>5} {'tokens':>7} {'kvd list':>9} {'kvd numpy':>10} {'sha256':>8} "
          f"{'sha256/kvd':>10}")
    for row in rows:
        print(f"{row['block_size']:5} {row['prompt_tokens']:7} {row['kvd_list_ns_per_token']:9.1f} "
              f"{row['kvd_numpy_ns_per_token']:10.1f} {row['sha256_pickle_ns_per_token']:8.1f} "
              f"{row['baseline_over_kvd_list']:9.2f}x")


def run_bench(quick: bool, out: Path) -> str:
    """`python -m bench` calls this (quick: 4k-token prompts, 3 repeats each); returns markdown."""
    rows = [measure(block_size, num_tokens, 0.0 if quick else 0.5)
            for block_size in BLOCK_SIZES
            for num_tokens in (PROMPT_TOKENS[:1] if quick else PROMPT_TOKENS)]
    write_json(out, "hashing", {"hash_version": kvd.HASH_VERSION,
                                "python": sys.version.split()[0], "rows": rows})
    lines = ["| block | prompt tokens | kvd list ns/token | kvd numpy ns/token | "
             "sha256+pickle ns/token | sha256 / kvd |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['block_size']} | {r['prompt_tokens']} | {r['kvd_list_ns_per_token']:.1f} | "
              f"{r['kvd_numpy_ns_per_token']:.1f} | {r['sha256_pickle_ns_per_token']:.1f} | "
              f"{r['baseline_over_kvd_list']:.2f}x |" for r in rows]
    return ("## Hashing: kvd.hash_blocks vs a SHA-256/pickle chain (bench/hashing.py)\n\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=0.5,
                        help="seconds of repeats per measurement (at least 3 repeats)")
    parser.add_argument("--out", type=Path, help="directory to write hashing.json into")
    args = parser.parse_args(argv)
    rows = []
    for block_size in BLOCK_SIZES:
        for num_tokens in PROMPT_TOKENS:
            print(f"block {block_size}, {num_tokens} tokens ...", file=sys.stderr, flush=True)
            rows.append(measure(block_size, num_tokens, args.budget_s))
    print_table(rows)
    if args.out:
        write_json(args.out, "hashing", {"hash_version": kvd.HASH_VERSION,
                                         "python": sys.version.split()[0], "rows": rows})


if __name__ == "__main__":
    main()
