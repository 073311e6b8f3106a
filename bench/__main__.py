"""`python -m bench`: every benchmark in one run: JSON, a markdown table and PNG plots.

Each bench module exposes `run_bench(quick: bool, out: Path) -> str`: it measures (kvd next to its
floor or alternative, side by side in the same run), writes its JSON and PNG under `out` and
returns a markdown section. This harness runs them in turn, shows progress on stderr, and writes
`out/RESULTS.md` with every section plus the host, the commit measured and the time each bench
took. Diagnostics that explain a measurement rather than make one (bench/diagnostics/) and the
A/B of the pool against a revision (bench/pool_ab.py) run on their own.

    python -m bench                 # full run, about 10 minutes on 2 cores, into bench/results/
    python -m bench --quick         # smoke run (CI), a minute or two, into a temp dir
    python -m bench --only control_plane,data_plane --out /tmp/b

Exit status 1 if any bench failed (the others still run and RESULTS.md lists the failure).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from bench.common import ROOT, progress
from kvd import native

# In the order they run: the control plane first, while the machine is quietest.
BENCHES = ("control_plane", "request_path", "scaling", "data_plane", "e2e", "policies",
           "hit_ratio", "pool", "hashing", "recovery", "journal_commit", "pool_journals",
           "seal_throughput",
           "transformers_e2e", "embedded", "client_threads", "arena_waste",
            "hostile", "remote")


def commit() -> str:
    """The commit measured, `+changes` where kvd/, bench/ (but its results) or workers/ differ."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
    changed = git("status", "--porcelain", "--", "kvd", "bench", "workers",
                  ":!bench/results").strip()
    return (git("rev-parse", "--short", "HEAD").strip() or "unknown") + (" +changes" if changed
                                                                        else "")


def header(quick: bool, argv: list[str]) -> str:
    command = " ".join(["python -m bench", *argv])
    compiled = ", ".join(f"{name} {state}" for name, state in native.status().items())
    return (f"# kvd benchmark results{' (quick smoke run)' if quick else ''}\n\n"
            f"Made by `{command}` at commit {commit()}: {os.cpu_count()} CPUs, "
            f"{platform.machine()}, Linux {platform.release()}, Python "
            f"{platform.python_version()}, NumPy {np.__version__}; compiled modules: {compiled}. "
            "Every figure is kvd next to its floor or alternative measured in the same run; "
            "ratios are what carry over between machines.\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (CI): tiny sizes")
    parser.add_argument("--out", type=Path, help="output directory (default: bench/results, "
                        "or a new temp dir with --quick)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHES)}")
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="kvd-bench-")) if args.quick
                       else ROOT / "bench" / "results")
    names = args.only.split(",") if args.only else list(BENCHES)
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        parser.error(f"unknown benches {unknown}: choose from {', '.join(BENCHES)}")
    out.mkdir(parents=True, exist_ok=True)
    sections, timings, failed = [header(args.quick, argv)], [], []
    started = time.monotonic()
    for index, name in enumerate(names, 1):
        progress(f"=== {name} ({index}/{len(names)}), {time.monotonic() - started:.0f} s so far")
        began = time.monotonic()
        try:
            sections.append(importlib.import_module(f"bench.{name}").run_bench(args.quick, out))
        except Exception as exc:  # keep going: one broken bench must not hide the others
            traceback.print_exc()
            failed.append(name)
            sections.append(f"## bench/{name}.py\n\nFAILED: {type(exc).__name__}: {exc}\n")
        timings.append(f"{name} {time.monotonic() - began:.0f} s")
    total_s = time.monotonic() - started
    sections.append(f"Time per bench: {', '.join(timings)}; total {total_s:.0f} s.\n")
    (out / "RESULTS.md").write_text("\n".join(section for section in sections if section))
    progress(f"done in {total_s:.0f} s: {out / 'RESULTS.md'}"
             + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
