"""Shared helpers of the benches: a real daemon in a subprocess, timing, and result files.

Every bench in `python -m bench` measures kvd next to a floor or an alternative in the same run
(the machines are noisy, so only ratios taken side by side mean anything). The helpers here keep
that uniform: `Daemon` runs `kvd start` exactly as a user would (a subprocess with its own
runtime directory, stopped with SIGTERM, leaving nothing in /dev/shm), `percentiles` and
`best_rate` turn samples into the numbers the tables show, and `write_json` / `save_plot` put
results under the output directory with small PNGs (dpi 100).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import kvd

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACES = ROOT.parent / "shared" / "traces"
PLOT_DPI = 100

# Small blocks keep the segment tiny where only metadata is measured (control plane, scaling).
TINY_GEOMETRY = {"layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": 16, "dtype": "float16"}


def progress(message: str) -> None:
    """One progress line on stderr (stdout stays for tables)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def child_env(runtime_dir: str | None = None) -> dict[str, str]:
    """This checkout importable, one BLAS thread; a private runtime dir when given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    if runtime_dir is not None:
        env["XDG_RUNTIME_DIR"] = runtime_dir
    return env


class Daemon:
    """`kvd start` in a subprocess with a private runtime dir; a context manager.

    `socket_path` is what `kvd.connect` takes (also from other processes, which need not share
    our environment).
    """

    def __init__(self, num_blocks: int, journal: bool = False, policy: str = "default",
                 **geometry: Any) -> None:
        self.runtime_dir = tempfile.mkdtemp(prefix="kvdb-", dir="/tmp")
        self.name = f"bench-{uuid.uuid4().hex[:8]}"
        self.socket_path = os.path.join(self.runtime_dir, "kvd", f"{self.name}.sock")
        self.log_path = os.path.join(self.runtime_dir, "daemon.log")
        command = [sys.executable, "-m", "kvd.cli", "start", "--name", self.name,
                   "--num-blocks", str(num_blocks), "--policy", policy, "--log-level", "WARNING"]
        for key, value in {**TINY_GEOMETRY, **geometry}.items():
            command += [f"--{key.replace('_', '-')}", str(value)]
        if not journal:
            command.append("--no-journal")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, env=child_env(self.runtime_dir), cwd=ROOT,
                                         stdout=log, stderr=log)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd start exited with {self.proc.returncode}: {self.log()}")
            try:
                kvd.connect(self.socket_path, reconnect_timeout_s=0).close()
                return
            except kvd.KvdError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvd start not ready in {timeout_s} s: {self.log()}")
                time.sleep(0.02)

    def connect(self) -> kvd.Client:
        return kvd.connect(self.socket_path, reconnect_timeout_s=0)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as file:
            return file.read()[-2000:]

    def stop(self) -> None:
        """SIGTERM, wait, and remove the runtime dir; raise if the daemon left anything."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        segment = f"/dev/shm/kvd-{os.getuid()}-{self.name}"
        if os.path.exists(segment):
            os.unlink(segment)
            raise RuntimeError(f"daemon {self.name} left its segment behind: {self.log()}")

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


# ---- timing ---------------------------------------------------------------------------------
def percentiles(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50 and p99 of samples in ns, returned in microseconds."""
    ordered = sorted(samples_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3
    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "n": len(ordered)}


def best_seconds(func: Callable[[], Any], repeats: int, min_time_s: float = 0.0) -> float:
    """Best wall time of `func` over at least `repeats` calls (and `min_time_s` spent)."""
    best, spent, count = float("inf"), 0.0, 0
    while count < repeats or spent < min_time_s:
        start = time.perf_counter()
        func()
        elapsed = time.perf_counter() - start
        best, spent, count = min(best, elapsed), spent + elapsed, count + 1
    return best


# ---- results --------------------------------------------------------------------------------
def write_json(out: Path, name: str, results: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path


def printed_section(title: str, print_tables: Callable[[Any], None], results: Any) -> str:
    """A markdown section holding what `print_tables(results)` prints, as a text block (for the
    benches whose tables are fixed-width text)."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_tables(results)
    return f"## {title}\n\n```text{text.getvalue()}```\n"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    return plt


def save_plot(figure: Any, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=PLOT_DPI)
    pyplot().close(figure)
    return path


def bench_main(doc: str, run_bench: Callable[[bool, Path], str],
               argv: list[str] | None = None) -> int:
    """`python -m bench.<name> [--quick] [--out DIR]`: run one bench, print its section."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny sizes)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    print(run_bench(args.quick, args.out))
    return 0


@contextlib.contextmanager
def one_cpu(*pids: int) -> Iterator[None]:
    """Pin these processes to one CPU (the lowest this process may use) for the block.

    Cross-process round trips on a small VM depend on where the scheduler puts the client and
    each server: on one vCPU or two (an IPI, maybe a halted vCPU to wake), next to whatever else
    runs. Between identical runs that moved the batch-1 ratio from 0.8x to 3x. With the client,
    the echo server and the daemon on one CPU, kvd and its floor always meet the same conditions.
    """
    cpu = min(os.sched_getaffinity(os.getpid()))
    with pinned({pid: cpu for pid in pids}):
        yield


@contextlib.contextmanager
def pinned(cpu_of: dict[int, int]) -> Iterator[None]:
    """Pin each process to its CPU for the block, then restore their CPU sets."""
    saved = {pid: os.sched_getaffinity(pid) for pid in cpu_of}
    try:
        for pid, cpu in cpu_of.items():
            os.sched_setaffinity(pid, {cpu})
        yield
    finally:
        for pid, cpus in saved.items():
            os.sched_setaffinity(pid, cpus)
