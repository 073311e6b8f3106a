"""The pool's batch ops against an earlier revision of the pool and its policies, in one process.

Separate runs of bench/pool.py on a shared VM drift by more than a pool change is worth (the same
code read 561k and 829k block-lookups/s in consecutive runs), so this bench loads kvd/core/pool.py,
kvd/errors.py and kvd/core/policies/ as they were at `--base` (`git show`) as a package of their own
next to the working tree's (with this build's C loops, kvd/core/_pool.c and kvd/core/policies/_s3fifo.c,
where the base has the same C source; a base without them runs Python), and drives both pools
with the same workload in alternating chunks; only their ratio is reported.

Each round at batch B, on a pool large enough that nothing is evicted (bench/pool.py measures
full pools): allocate B → seal under B fresh 16-byte keys (with --chains, each block's parent
the one before it, as the page table seals) → release (CACHED) → lookup (pinned again) →
release, each call timed. `--base python` compares the working tree's C loops with the Python
loops they stand in for (the pool's and its policy's `_loops` set to None).

    python -m bench.pool_ab [--base REV] [--policy NAME] [--batch B] [--chunks N] [--chains]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import kvd.core.pool
from bench.common import ROOT, markdown_table
from bench.pool import OWNER, digests
from kvd.core.policies import DEFAULT_POLICY

OPS = ("allocate", "seal", "release", "lookup", "release again")
ROUNDS_PER_CHUNK = 10


BASE_PACKAGE = "kvd_base"
PURE = "python"  # --base: the working tree with its C loops off (their specification)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def pool_module_at(revision: str, directory: str) -> ModuleType:
    """kvd.core.pool as committed at `revision` (with that revision's errors and policies), imported
    as package BASE_PACKAGE from `directory`."""
    package = Path(directory) / BASE_PACKAGE
    (package / "policies").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    paths = ["kvd/core/pool.py", "kvd/errors.py"] + git("ls-tree", "--name-only", revision,
                                                    "kvd/core/_pool.c", "kvd/core/policies/").split()
    # Imports of the copied modules go to the base package, any other to kvd itself.
    copied = {path.removesuffix(".py").removesuffix(".c").replace("/", ".") for path in paths}
    copied |= {"kvd.core.policies"}

    def rebase(match: re.Match) -> str:  # from (package) import (name)
        if match[1] in copied or f"{match[1]}.{match[2]}" in copied:
            return match[0].replace("kvd", BASE_PACKAGE, 1)
        return match[0]

    for path in paths:
        source = git("show", f"{revision}:{path}")
        if path.endswith(".c"):
            copy_extension(revision, path, source, package)
            continue
        source = re.sub(r"from (kvd(?:\.[\w.]+)?) import (\w+)?", rebase, source)
        (package / Path(path).relative_to("kvd")).write_text(source)
    sys.path.insert(0, directory)
    try:
        return importlib.import_module(f"{BASE_PACKAGE}.pool")
    finally:
        sys.path.remove(directory)


def copy_extension(revision: str, path: str, source: str, package: Path) -> None:
    """The base's C loops are this build's when their source is the same: the built module is
    copied into the base package (its init function's name is all an import needs). A base
    whose C differs is refused: this bench does not compile."""
    name = path.removesuffix(".c").replace("/", ".")
    if source != (ROOT / path).read_text():
        raise SystemExit(f"{path} at {revision} differs from the working tree's: pool_ab cannot "
                         "build it; compare against a revision with the same C source")
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{name} is not built here: `pip install -e .` first")
    shutil.copy(spec.origin, package / Path(spec.origin).relative_to(ROOT / "kvd"))


def without_c_loops(pool: kvd.core.pool.BlockPool) -> kvd.core.pool.BlockPool:
    pool._loops = None
    for policy in [pool.policy, *getattr(pool.policy, "policies", ())]:  # (a tiered one's tiers)
        if hasattr(policy, "_loops"):
            policy._loops = None
    return pool


def run(base: str, policy: str, batch: int, num_chunks: int,
        chains: bool) -> dict[str, dict[str, float]]:
    num_blocks = 1 << max(16, (4 * batch).bit_length())
    if base == PURE:
        pools = {"base": without_c_loops(kvd.core.pool.BlockPool(num_blocks, policy))}
    else:
        with tempfile.TemporaryDirectory(prefix="kvd-pool-ab-") as directory:
            pools = {"base": pool_module_at(base, directory).BlockPool(num_blocks, policy)}
    pools["working tree"] = kvd.core.pool.BlockPool(num_blocks, policy)
    samples = {name: {op: [] for op in OPS} for name in pools}
    clock, key = time.perf_counter_ns, 0
    for chunk in range(num_chunks + 1):  # the first chunk warms up and is dropped
        for name, pool in pools.items():
            for _ in range(ROUNDS_PER_CHUNK):
                key += batch
                keys = digests(key, batch)
                times = [clock()]
                block_ids = pool.allocate(batch, OWNER)
                times.append(clock())
                # (as a page table seals a chain: each block's parent is the one before it)
                pool.seal(block_ids, keys, OWNER, [None, *keys[:-1]] if chains else None)
                times.append(clock())
                pool.release(block_ids, OWNER)
                times.append(clock())
                pool.lookup(keys, OWNER)
                times.append(clock())
                pool.release(block_ids, OWNER)
                times.append(clock())
                if chunk:
                    for op, start, end in zip(OPS, times, times[1:]):
                        samples[name][op].append(end - start)
    return {name: {op: sorted(values)[len(values) // 2] / 1e3 for op, values in ops.items()}
            for name, ops in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD",
                        help=f"git revision of kvd/core/pool.py to compare, or {PURE!r}: the working "
                             "tree's pool with its C loops off")
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--chains", action="store_true",
                        help="seal each batch as a chain (parents), as the page table does")
    args = parser.parse_args(argv)
    medians = run(args.base, args.policy, args.batch, args.chunks, args.chains)
    base, mine = medians["base"], medians["working tree"]
    print(f"BlockPool at {args.base} vs the working tree, policy {args.policy}, batch "
          f"{args.batch}{' (chains)' if args.chains else ''}, {args.chunks} chunks of "
          f"{ROUNDS_PER_CHUNK} rounds each in turns (median µs per call)\n")
    print(markdown_table(["op", f"{args.base} µs", "working tree µs", "working tree / base"],
                         [[op, f"{base[op]:.1f}", f"{mine[op]:.1f}", f"{mine[op] / base[op]:.2f}x"]
                          for op in OPS]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
