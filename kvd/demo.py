"""`kvd demo`: a daemon, several attention workers sharing prompt prefixes, and what happened.

Theory of operation
-------------------
1. Start a daemon (`python -m kvd.cli start`) under a fresh name in its own process group, with a
   small geometry that matches the workers' model, and wait until it accepts connections.
2. Start `--workers` processes of `python -m workers.attention` at once. Each runs multi-turn
   conversations over a few system prompts shared by all workers (workers/attention.py), with
   its KV in the daemon's shared memory: a prompt's cached prefix — a system prompt another
   worker already computed, or the conversation's own earlier turns — is not prefilled again.
3. Print each worker's tokens/s, prefix hit ratio and prefill tokens skipped, then the pool's
   block states, allocations and evictions from `Client.stats()`.
4. Stop everything — workers first, then the daemon with SIGTERM (its clean shutdown removes
   the socket and the segment) — on success, error, Ctrl-C or SIGTERM alike, and check that
   /dev/shm holds nothing of ours.

Children get their own session (process group) so a terminal's Ctrl-C reaches only the demo,
which then shuts them down in order instead of racing their own signal handlers. The workers live
in the `workers/` package next to `kvd/` (a source checkout); children get that directory on
PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from kvd.errors import DisconnectedError, InternalError, KvdError
from kvd.runtime import SHM_DIR, DaemonPaths, state_dir

SOURCE_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="attention worker processes")
    parser.add_argument("--system-prompts", type=int, default=3,
                        help="distinct system prompts shared by all workers")
    parser.add_argument("--system-tokens", type=int, default=512, help="tokens per system prompt")
    parser.add_argument("--conversations", type=int, default=4, help="conversations per worker")
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument("--user-tokens", type=int, default=48, help="tokens per user turn")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--num-blocks", type=int, default=256,
                        help="pool blocks (small enough that old conversations get evicted)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--layers", type=int, default=4, help="model layers")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (query heads: 2×)")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--policy", default=None, help="eviction policy (default: kvd's default)")
    parser.add_argument("--engine", choices=("numpy", "transformers"), default="numpy",
                        help="numpy: workers/attention.py; transformers: a Hugging Face Llama "
                             "on kvd (workers/hf_generate.py, needs the `engines` extra)")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    # One BLAS thread per worker: the workers already fill the cores; oversubscription only
    # adds context switches.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


def _daemon_command(args: argparse.Namespace, name: str) -> list[str]:
    command = [sys.executable, "-m", "kvd.cli", "start", "--name", name,
               "--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size),
               "--layers", str(args.layers), "--kv-heads", str(args.kv_heads),
               "--head-dim", str(args.head_dim), "--dtype", args.dtype]
    return command + (["--policy", args.policy] if args.policy else [])


def _worker_command(args: argparse.Namespace, name: str, worker_id: int) -> list[str]:
    common = ["--name", name, "--json", "--worker-id", str(worker_id),
              "--num-workers", str(args.workers), "--system-prompts", str(args.system_prompts),
              "--system-tokens", str(args.system_tokens), "--user-tokens", str(args.user_tokens),
              "--new-tokens", str(args.new_tokens)]
    if args.engine == "transformers":  # one-shot requests; the model's shape is the pool's
        return [sys.executable, "-m", "workers.hf_generate", *common,
                "--requests", str(args.workers * args.conversations * args.turns),
                "--layers", str(args.layers), "--kv-heads", str(args.kv_heads),
                "--head-dim", str(args.head_dim), "--dtype", args.dtype]
    return [sys.executable, "-m", "workers.attention", *common,
            "--conversations", str(args.conversations), "--turns", str(args.turns)]


def _as_demo_row(report: dict) -> dict:
    """A workers/hf_generate.py report in workers/attention.py's terms (format_workers')."""
    if "tokens_per_s" in report:
        return report
    return {"worker_id": report["worker_id"], "requests": report["requests"],
            "new_tokens": report["generated_tokens"],
            "tokens_per_s": report["generated_tokens"] / max(report["wall_s"], 1e-9),
            "prefix_hit_ratio": report["skipped_prefill_tokens"] / max(report["prompt_tokens"], 1),
            "cached_tokens": report["skipped_prefill_tokens"],
            "prompt_tokens": report["prompt_tokens"]}


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal a child we started and reap it; SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, name: str) -> None:
    import kvd  # the client; imported late so `kvd --help` stays light

    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise DisconnectedError(f"the demo daemon exited with status {proc.returncode} "
                                    "before it was ready; its log follows")
        try:
            kvd.connect(name).close()
            return
        except DisconnectedError:
            if time.monotonic() > deadline:
                raise DisconnectedError(f"the demo daemon was not ready after "
                                        f"{READY_TIMEOUT_S:.0f} s; its log follows") from None
            time.sleep(0.05)


@contextmanager
def running_daemon(args: argparse.Namespace, name: str) -> Iterator[subprocess.Popen]:
    """A foreground `kvd start` child, stopped (SIGTERM, then SIGKILL) however the block ends.

    Its log goes to a temporary file, shown only if something went wrong, so it does not
    interleave with the demo's report.
    """
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(_daemon_command(args, name), env=_child_env(), cwd=SOURCE_ROOT,
                                stdout=log, stderr=log, start_new_session=True)
        try:
            _wait_ready(proc, name)
            yield proc
        finally:
            _stop(proc)
            if proc.returncode != 0 or sys.exc_info()[0] is not None:
                log.seek(0)
                sys.stderr.write(f"--- kvd daemon log (exit status {proc.returncode}) ---\n"
                                 + log.read().decode(errors="replace"))


def run_workers(args: argparse.Namespace, name: str) -> list[dict]:
    """Start every worker at once; return their stats in worker order."""
    procs = [subprocess.Popen(_worker_command(args, name, i), env=_child_env(), cwd=SOURCE_ROOT,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
             for i in range(args.workers)]
    try:
        outputs = [proc.communicate()[0] for proc in procs]
    finally:
        for proc in procs:
            _stop(proc)
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        raise KvdError(f"demo workers {failed} failed (their errors are above); for a "
                       "NoSpaceError give the pool more --num-blocks or the workload fewer tokens")
    return [_as_demo_row(json.loads(out.strip().splitlines()[-1])) for out in outputs]


def format_workers(results: list[dict], wall_s: float) -> str:
    lines = ["worker  requests  tokens  tokens/s  prefix hit  prefill skipped (tokens)"]
    for r in results:
        lines.append(f"{r['worker_id']:>6}  {r['requests']:>8}  {r['new_tokens']:>6}  "
                     f"{r['tokens_per_s']:>8.0f}  {r['prefix_hit_ratio']:>10.1%}  "
                     f"{r['cached_tokens']:>7} of {r['prompt_tokens']}")
    cached = sum(r["cached_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    tokens = sum(r["new_tokens"] for r in results)
    lines.append(f"{'all':>6}  {sum(r['requests'] for r in results):>8}  {tokens:>6}  "
                 f"{tokens / wall_s:>8.0f}  {cached / prompt if prompt else 0.0:>10.1%}  "
                 f"{cached:>7} of {prompt}   (all: tokens/s over {wall_s:.1f} s wall)")
    return "\n".join(lines)


def format_pool(stats: dict) -> str:
    num_blocks = stats["num_blocks"]
    in_use = num_blocks - stats["free"]
    return (f"pool: {in_use}/{num_blocks} blocks in use ({in_use / num_blocks:.0%}): "
            f"{stats['cached']} cached, {stats['sealed']} sealed and pinned, {stats['owned']} "
            f"being written, {stats['free']} free; {stats['allocations']} allocations, "
            f"{stats['seals']} seals, {stats['evictions']} evictions")


def _leftovers(name: str) -> list[str]:
    paths = DaemonPaths.for_name(name)
    candidates = [SHM_DIR + paths.segment_name, str(state_dir(name)), paths.socket_path,
                  paths.pid_path, paths.lock_path]
    return [path for path in candidates if os.path.exists(path)]


def _has_engines() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(module) for module in ("torch", "transformers"))


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through the same cleanup as Ctrl-C


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 on success (and nothing left behind), 1 on failure, 130 on Ctrl-C."""
    if args.workers < 1:
        print("kvd demo: --workers must be at least 1", file=sys.stderr)
        return 2
    if not (SOURCE_ROOT / "workers" / "attention.py").is_file():
        print(f"kvd demo: needs the workers/ package next to kvd/ in {SOURCE_ROOT}: run it from "
              "a source checkout of kvd", file=sys.stderr)
        return 1
    if args.engine == "transformers" and not _has_engines():
        print("kvd demo: --engine transformers needs torch and transformers: "
              "pip install -e '.[engines]'", file=sys.stderr)
        return 1
    name = f"demo-{os.getpid()}-{secrets.token_hex(3)}"
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        status = _run_demo(args, name)
    except KeyboardInterrupt:
        print("kvd demo: interrupted; daemon and workers stopped", file=sys.stderr)
        status = 130
    except KvdError as exc:
        print(f"kvd demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    left = _leftovers(name)
    if left:
        print(f"kvd demo: left behind {', '.join(left)}: remove them by hand", file=sys.stderr)
        return status or 1
    if status == 0:
        print("nothing left behind: no socket, pidfile, lock file, segment or journal")
    return status


def _run_demo(args: argparse.Namespace, name: str) -> int:
    import kvd

    started = time.perf_counter()
    with running_daemon(args, name) as daemon:
        with kvd.connect(name) as client:
            g = client.geometry
            print(f"kvd demo: daemon {name!r}: {g.num_blocks} blocks of {g.block_size} tokens, "
                  f"{g.num_layers} layers x {g.num_kv_heads} KV heads x {g.head_dim}, {g.dtype} "
                  f"({g.pool_nbytes / 2**20:.1f} MiB), policy {client.stats()['policy']}")
            work = f"{args.conversations} conversations x {args.turns} turns"
            if args.engine == "transformers":  # (workers/hf_generate.py has no conversations)
                work += " (transformers Llama: each turn a one-shot request)"
            print(f"{args.workers} workers x {work}; {args.system_prompts} system prompts of "
                  f"{args.system_tokens} tokens shared by all workers; {args.new_tokens} tokens "
                  "generated per request\n",
                  flush=True)  # a reader on a pipe sees progress before the workers finish
            workers_started = time.perf_counter()
            results = run_workers(args, name)
            wall_s = time.perf_counter() - workers_started
            print(format_workers(results, wall_s))
            print(format_pool(client.stats()))
    if daemon.returncode != 0:
        raise InternalError(f"the demo daemon exited with status {daemon.returncode} on SIGTERM")
    print(f"daemon stopped; demo took {time.perf_counter() - started:.1f} s")
    return 0
