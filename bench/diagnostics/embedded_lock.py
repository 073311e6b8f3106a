"""What `PagedKVCache`'s lock costs a single thread, in instructions (valgrind's callgrind).

bench/embedded.py times the public methods against the same code less the lock; this counts
instructions, which a busy host cannot disturb. Each arm runs the bench's op mix (2 of 3 ops
allocate a new pair, evicting; 1 of 3 gets the last one) in a child under callgrind, twice, with
N and 5N ops after the same warm-up: the difference over 4N ops is the instructions per op,
interpreter start and imports cancelled out. `PYTHONHASHSEED=0` and one BLAS thread keep the
runs alike.

Valgrind runs `rep stosb` -- glibc's memset for the 16 KiB zeroing of a reused block -- one
iteration per byte, so the default geometry's rows count ~16k "instructions" per allocation that
the CPU does in a few hundred cycles: there the lock's share of the instructions understates its
share of the time. The 1-element rows (no zeroing to speak of) are the metadata path alone.
Not part of `python -m bench`: it takes minutes, and needs valgrind.

    python -m bench.diagnostics.embedded_lock [--ops N]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from types import MethodType

from bench.common import ROOT, child_env, markdown_table
from bench.embedded import NUM_BLOCKS, TINY, _allocate_unlocked, _get_unlocked, filled, ops_of

ARMS = ("kvd", "kvd_unlocked")
WARMUP_OPS = 600


def run_child(arm: str, policy: str, size: int, num_ops: int) -> None:
    """The arm's op mix, `num_ops` ops after the warm-up (the child's side)."""
    cache = filled(policy, size, TINY if size == TINY else 128)
    if arm == "kvd":
        run_ops = ops_of(cache.allocate_block, cache.get_block)
    else:
        run_ops = ops_of(MethodType(_allocate_unlocked, cache), MethodType(_get_unlocked, cache))
    run_ops(NUM_BLOCKS, NUM_BLOCKS + WARMUP_OPS)
    first = NUM_BLOCKS + WARMUP_OPS
    run_ops(first, first + num_ops)


def instructions(arm: str, policy: str, size: int, num_ops: int, directory: str) -> int:
    """Instructions callgrind counts for a whole child run."""
    env = {**child_env(), "PYTHONHASHSEED": "0"}
    out = os.path.join(directory, f"callgrind.{arm}.{policy}.{size}.{num_ops}")
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
         "bench.diagnostics.embedded_lock", "--child", arm, policy, str(size), str(num_ops)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    match = re.search(r"refs:\s+([\d,]+)", done.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output: {done.stderr[-500:]}")
    return int(match.group(1).replace(",", ""))


def per_op(arm: str, policy: str, size: int, num_ops: int, directory: str) -> float:
    few = instructions(arm, policy, size, num_ops, directory)
    many = instructions(arm, policy, size, 5 * num_ops, directory)
    return (many - few) / (4 * num_ops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="N (the runs do N and 5N ops)")
    parser.add_argument("--child", nargs=4, metavar=("ARM", "POLICY", "SIZE", "OPS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        arm, policy, size, num_ops = args.child
        run_child(arm, policy, int(size), int(num_ops))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing to count", file=sys.stderr)
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for policy in ("lru", "lfu"):
            for size, label in ((16, "16 KiB"), (TINY, "1 element")):
                counts = {arm: per_op(arm, policy, size, args.ops, directory) for arm in ARMS}
                extra = counts["kvd"] - counts["kvd_unlocked"]
                rows.append([policy, label, f"{counts['kvd']:,.0f}",
                             f"{counts['kvd_unlocked']:,.0f}", f"{extra:,.0f}",
                             f"{100 * extra / counts['kvd_unlocked']:+.1f} %"])
    print(markdown_table(["policy", "blocks", "instructions/op", "less the lock", "the lock's",
                          "lock's share"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
