"""The pool's batch ops against an earlier revision of kvd/core, in one process, in turns.

Separate runs of bench/pool.py on a shared VM drift by more than a pool change is worth, so this
bench imports kvd/core/ (pool and policies) as it was at `--base` (`git show`) as a package of
its own, `kvd_base.core`, next to the working tree's, and drives both pools with the same
workload in alternating chunks; only their ratio is reported. Both run this build's compiled
modules (kvd/native.py loads them by name), unless the base's C sources differ from the working
tree's: then the base's are compiled into the copy and its pool loads those. `--base python` instead compares the working tree's pool with its compiled
loops against the same pool in pure Python (KVD_PURE_PYTHON=1 while the copy is imported and
built): what the C buys.

Each round at batch B, on a pool large enough that nothing is evicted (bench/pool.py measures
full pools): allocate B → seal under B fresh 16-byte keys (with --chains, each block's parent
the one before it, as the page table seals) → release (CACHED) → lookup (pinned again) →
release, each call timed.

    python -m bench.pool_ab [--base REV|python] [--policy NAME] [--batch B] [--chunks N] [--chains]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kvd.core.pool
from bench.common import OWNER, ROOT, digests, markdown_table
from kvd import native
from kvd.core.policies import DEFAULT_POLICY

OPS = ("allocate", "seal", "release", "lookup", "release again")
ROUNDS_PER_CHUNK = 10
BASE_PACKAGE = "kvd_base"
PURE = "python"  # --base: the working tree with its compiled loops off (their specification)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def core_files(revision: str) -> dict[str, str]:
    """kvd/core/'s files by path: at `revision`, or in the working tree for PURE."""
    if revision == PURE:
        return {str(path.relative_to(ROOT)): path.read_text()
                for path in sorted((ROOT / "kvd" / "core").rglob("*"))
                if path.suffix in (".py", ".c", ".h")}
    paths = git("ls-tree", "-r", "--name-only", revision, "kvd/core/").split()
    return {path: git("show", f"{revision}:{path}") for path in paths}


@contextlib.contextmanager
def pure_python(is_pure: bool) -> Iterator[None]:
    """KVD_PURE_PYTHON=1 for the block, where asked (kvd/native.py reads it at each load)."""
    saved = os.environ.get(native.PURE_PYTHON_ENV)
    if is_pure:
        os.environ[native.PURE_PYTHON_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(native.PURE_PYTHON_ENV, None)
        else:
            os.environ[native.PURE_PYTHON_ENV] = saved


def base_pool(revision: str, directory: str, num_blocks: int, policy: str) -> Any:
    """A BlockPool of kvd/core as at `revision`, imported as BASE_PACKAGE.core from
    `directory` (imports of kvd.core rewritten to it; any other stays kvd's)."""
    files = core_files(revision)
    own_c = revision != PURE and any(
        path.endswith((".c", ".h")) and (not (ROOT / path).is_file()
                                         or (ROOT / path).read_text() != source)
        for path, source in files.items())
    for path, source in files.items():
        if path.endswith((".c", ".h")) and revision != PURE and not own_c:
            continue
        target = Path(directory) / BASE_PACKAGE / Path(path).relative_to("kvd")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(re.sub(r"\b(from|import) kvd\.core\b", rf"\1 {BASE_PACKAGE}.core",
                                 source))
    for path in files if own_c else ():
        if path.endswith(".c"):
            compile_module(Path(directory) / BASE_PACKAGE / Path(path).relative_to("kvd"))
    (Path(directory) / BASE_PACKAGE / "__init__.py").write_text("")
    sys.path.insert(0, directory)
    try:
        with pure_python(revision == PURE), base_modules(own_c):
            return importlib.import_module(f"{BASE_PACKAGE}.core.pool").BlockPool(num_blocks,
                                                                                  policy)
    finally:
        sys.path.remove(directory)


def compile_module(source: Path) -> None:
    """The base's own C module beside its source (and its headers)."""
    subprocess.run([sysconfig.get_config_var("CC").split()[0], "-shared", "-fPIC", "-O2",
                    f"-I{sysconfig.get_paths()['include']}", str(source), "-o",
                    str(source.with_suffix(sysconfig.get_config_var("EXT_SUFFIX")))], check=True)


@contextlib.contextmanager
def base_modules(is_own: bool) -> Iterator[None]:
    """kvd/native.py loads the base's compiled kvd/core modules while it is imported, where it
    has its own."""
    saved = dict(native.MODULES)
    if is_own:
        for name, (module, what) in saved.items():
            if module.startswith("kvd.core."):
                native.MODULES[name] = (module.replace("kvd", BASE_PACKAGE, 1), what)
    try:
        yield
    finally:
        native.MODULES.update(saved)


def run(base: str, policy: str, batch: int, num_chunks: int,
        chains: bool) -> dict[str, dict[str, float]]:
    num_blocks = 1 << max(16, (4 * batch).bit_length())
    with tempfile.TemporaryDirectory(prefix="kvd-pool-ab-") as directory:
        pools = {"base": base_pool(base, directory, num_blocks, policy),
                 "working tree": kvd.core.pool.BlockPool(num_blocks, policy)}
    samples: dict[str, dict[str, list[int]]] = {name: {op: [] for op in OPS} for name in pools}
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
                        help=f"git revision of kvd/core/ to compare, or {PURE!r}: the working "
                             "tree's pool in pure Python")
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
