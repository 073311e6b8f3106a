"""`python -m bench`: every benchmark in one run — JSON, a markdown table and PNG plots.

Each bench module exposes `run_bench(quick: bool, out: Path) -> str`: it measures (kvd next to its
floor or alternative, side by side in the same run), writes its JSON and PNG under `out` and
returns a markdown section. This harness runs them in turn, shows progress on stderr, and writes
`out/RESULTS.md` with every section plus the host and the time each bench took.
A bench module that has no `run_bench` yet is run as `python -m bench.<name> --out DIR` (full
runs only) and its printed output is kept verbatim.

    python -m bench                 # full run, <= 10 minutes on 2 cores, into bench/results/
    python -m bench --quick         # smoke run (CI), well under a minute, into a temp dir
    python -m bench --only control_plane,data_plane --out /tmp/b

Exit status 1 if any bench failed (the others still run and RESULTS.md lists the failure).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from bench.common import ROOT, child_env, progress

# In the order they run: the control plane first, while the machine is quietest.
BENCHES = ("control_plane", "request_path", "scaling", "data_plane", "e2e", "policies",
           "hit_ratio", "pool", "hashing", "recovery", "transformers_e2e")


def run_one(name: str, quick: bool, out: Path) -> str:
    """The markdown section of bench `name`, or a note saying why it was skipped."""
    spec = importlib.util.find_spec(f"bench.{name}")
    if spec is None:
        return ""  # not in this checkout
    # Read before importing: a bench without run_bench may import heavy things (torch).
    if "def run_bench(" in Path(spec.origin).read_text():
        return importlib.import_module(f"bench.{name}").run_bench(quick, out)
    if quick:
        return f"## bench/{name}.py\n\nSkipped in --quick: it has no run_bench(quick, out).\n"
    result = subprocess.run([sys.executable, "-m", f"bench.{name}", "--out", str(out)],
                            env=child_env(), cwd=ROOT, capture_output=True, text=True)
    missing = re.search(r"ModuleNotFoundError: No module named '([^']+)'", result.stderr)
    if result.returncode and missing:
        return f"## bench/{name}.py\n\nSkipped: {missing.group(1)} is not installed.\n"
    if result.returncode:
        raise RuntimeError(f"python -m bench.{name} exited {result.returncode}: "
                           f"{result.stderr[-2000:]}")
    return f"## bench/{name}.py\n\n```text\n{result.stdout.strip()}\n```\n"


def header(quick: bool, argv: list[str]) -> str:
    command = " ".join(["python -m bench", *argv])
    return (f"# kvd benchmark results{' (quick smoke run)' if quick else ''}\n\n"
            f"Made by `{command}` on {time.strftime('%Y-%m-%d %H:%M %Z')}: "
            f"{os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}, "
            f"Python {platform.python_version()}, NumPy {np.__version__}. Every figure is kvd "
            "next to its floor or alternative measured in the same run; ratios are what carry "
            "over between machines.\n")


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
            sections.append(run_one(name, args.quick, out))
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
