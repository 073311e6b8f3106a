"""Trace load generator: replay a block-hash trace across N worker processes against a daemon.

Theory of operation
-------------------
A Mooncake-format trace (kvd/traces.py) gives each request its prompt as prefix-chained ids of
512-token blocks — no text. The generator turns each id into a deterministic block of token ids
(seeded by the id), so equal ids give equal tokens and equal trace prefixes become equal token
prefixes: kvd's own content hashes then find exactly the reuse the trace recorded, even when the
pool's block size differs from the trace's.

`--scale S` shrinks every length by S (a 512-token trace block becomes 512/S tokens; prompt and
output lengths are divided by S, rounding up) so a trace made for a GPU cluster fits a small pool
and a NumPy model. With S = 512 / pool block size, one trace block is one kvd block.

The parent starts N copies of itself (`--worker-index i`), each replaying requests i, i+N, ...
in trace order, as fast as it can (timestamps are ignored: this measures throughput, not
latency under an arrival process). A worker runs the attention model of workers/attention.py on
every request (prefill past the cached prefix, then greedy decode), or with `--no-model` only the
kvd calls (open, commit, extend, close), which measures the daemon rather than NumPy. A request
the pool cannot hold (NoSpaceError) is counted as rejected, not fatal. Each worker prints one
JSON line; the parent adds them up with the daemon's eviction counter before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import kvd
from kvd.traces import TRACE_BLOCK_TOKENS, Request, load_trace
from workers.attention import KvdDecoder, config_for_geometry, drop_frames, model_salt
from workers.model import DecoderLM

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


def block_tokens(hash_id: int, num_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """The token ids standing for trace block `hash_id` (same id → same tokens, any process)."""
    return np.random.default_rng([seed, hash_id]).integers(0, vocab_size, num_tokens)


def scaled_lengths(request: Request, scale: int) -> tuple[int, int, int]:
    """(tokens per trace block, prompt tokens, output tokens) after dividing by `scale`."""
    return (max(1, TRACE_BLOCK_TOKENS // scale), max(1, -(-request.input_length // scale)),
            max(1, -(-request.output_length // scale)))


def prompt_tokens(request: Request, scale: int, vocab_size: int, seed: int) -> np.ndarray:
    per_block, num_tokens, _ = scaled_lengths(request, scale)
    blocks = [block_tokens(h, per_block, vocab_size, seed) for h in request.hash_ids]
    return np.concatenate(blocks)[:num_tokens]


@dataclass
class ReplayStats:
    worker_index: int
    requests: int = 0
    rejected: int = 0           # NoSpaceError: the pool could not hold the request
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    elapsed_s: float = 0.0


class KvdOnly:
    """A request's kvd calls without the model: what the daemon sees from a real worker."""

    def __init__(self, client: kvd.Client, salt: bytes):
        self.client = client
        self.salt = salt

    def serve(self, prompt: np.ndarray, num_new_tokens: int) -> tuple[int, int]:
        seq = self.client.open_sequence(prompt, salt=self.salt)
        try:
            if num_new_tokens > 1:  # the last token is never fed back, as in decode
                self.client.extend_sequence(seq, [0] * (num_new_tokens - 1))
            self.client.commit_sequence(seq)
        finally:
            self.client.close_sequence(seq)
        return seq.num_cached_tokens, num_new_tokens


class ModelServer:
    """A request served by the attention worker: real prefill past the cache, greedy decode."""

    def __init__(self, decoder: KvdDecoder):
        self.decoder = decoder

    def serve(self, prompt: np.ndarray, num_new_tokens: int) -> tuple[int, int]:
        tokens, _ = self.decoder.generate(prompt, num_new_tokens)
        stats = self.decoder.last_request
        assert stats is not None  # (generate sets it)
        return stats.cached_tokens, len(tokens)


def replay_share(args: argparse.Namespace) -> ReplayStats:
    """Replay requests worker_index, worker_index + N, ... of the trace; return the totals."""
    requests = load_trace(args.trace)[:args.limit][args.worker_index::args.workers]
    with kvd.connect(args.name) as client:
        # The model server holds views of the segment: it must be gone before the client
        # unmaps it, so it lives only inside _replay.
        try:
            return _replay(client, requests, args)
        except BaseException as exc:
            drop_frames(exc)
            raise


def _replay(client: kvd.Client, requests: list[Request], args: argparse.Namespace
            ) -> ReplayStats:
    config = config_for_geometry(client.geometry, vocab_size=args.vocab_size, seed=args.seed)
    server = (KvdOnly(client, model_salt(config)) if args.no_model
              else ModelServer(KvdDecoder(client, DecoderLM(config))))
    stats = ReplayStats(args.worker_index)
    started = time.perf_counter()
    for request in requests:
        _serve_one(server, request, args, stats)
    stats.elapsed_s = time.perf_counter() - started
    return stats


def _serve_one(server: KvdOnly | ModelServer, request: Request, args: argparse.Namespace,
               stats: ReplayStats) -> None:
    prompt = prompt_tokens(request, args.scale, args.vocab_size, args.seed)
    num_new = min(scaled_lengths(request, args.scale)[2], args.max_new_tokens)
    try:
        cached, generated = server.serve(prompt, num_new)
    except kvd.NoSpaceError:
        stats.rejected += 1
        return
    stats.requests += 1
    stats.prompt_tokens += len(prompt)
    stats.cached_tokens += cached
    stats.new_tokens += generated


def _worker_command(args: argparse.Namespace, index: int) -> list[str]:
    command = [sys.executable, "-m", "workers.loadgen", str(args.trace.resolve()), "--worker-index",
               str(index), "--workers", str(args.workers), "--scale", str(args.scale),
               "--vocab-size", str(args.vocab_size), "--seed", str(args.seed),
               "--max-new-tokens", str(args.max_new_tokens)]
    if args.name:
        command += ["--name", args.name]
    if args.limit is not None:
        command += ["--limit", str(args.limit)]
    if args.no_model:
        command.append("--no-model")
    return command


def run_workers(args: argparse.Namespace) -> dict[str, float | int]:
    """Start the worker processes, wait for them, and sum up their stats and the daemon's."""
    with kvd.connect(args.name) as client:
        evicted_before = client.stats()["evictions"]
        procs = [subprocess.Popen(_worker_command(args, i), stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).resolve().parents[1])
                 for i in range(args.workers)]
        outputs = [proc.communicate()[0] for proc in procs]
        failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
        if failed:
            raise kvd.KvdError(f"load generator workers {failed} failed; see their stderr above")
        daemon = client.stats()
    shares = [ReplayStats(**json.loads(out.strip().splitlines()[-1])) for out in outputs]
    return summarize(shares, daemon["evictions"] - evicted_before, daemon)


def summarize(shares: list[ReplayStats], evictions: int, daemon: dict) -> dict[str, float | int]:
    total = {key: sum(getattr(s, key) for s in shares)
             for key in ("requests", "rejected", "prompt_tokens", "cached_tokens", "new_tokens")}
    elapsed_s = max(s.elapsed_s for s in shares)
    return {**total, "workers": len(shares), "elapsed_s": round(elapsed_s, 3),
            "requests_per_s": round(total["requests"] / elapsed_s, 1) if elapsed_s else 0.0,
            "prefix_hit_ratio": round(total["cached_tokens"] / total["prompt_tokens"], 4)
            if total["prompt_tokens"] else 0.0,
            "evictions": evictions, "pool_blocks": daemon["num_blocks"],
            "pool_blocks_cached": daemon["cached"], "pool_blocks_free": daemon["free"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.loadgen",
                                     description="Replay a block-hash trace against a kvd daemon.")
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE,
                        help=f"Mooncake-format JSONL trace (default {DEFAULT_TRACE})")
    parser.add_argument("--name", default=None, help="kvd daemon name or socket path")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--scale", type=int, default=32,
                        help="divide every length by this (512/scale tokens per trace block)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="cap on output tokens")
    parser.add_argument("--no-model", action="store_true",
                        help="make only the kvd calls (measures the daemon, not NumPy)")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def format_summary(summary: dict[str, float | int]) -> str:
    return (f"{summary['requests']} requests ({summary['rejected']} rejected for space) by "
            f"{summary['workers']} workers in {summary['elapsed_s']:.2f} s: "
            f"{summary['requests_per_s']} requests/s, prefix hit ratio "
            f"{summary['prefix_hit_ratio']:.1%} ({summary['cached_tokens']} of "
            f"{summary['prompt_tokens']} prompt tokens cached), {summary['evictions']} evictions, "
            f"pool {summary['pool_blocks_cached']}/{summary['pool_blocks']} blocks cached")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.trace.is_file():
        print(f"loadgen: skipped: trace {args.trace} is absent (the ../shared/traces folder holds "
              "the Mooncake traces; pass any trace in that JSONL format)", file=sys.stderr)
        return 0
    if args.scale <= 0 or args.workers <= 0 or args.max_new_tokens <= 0:
        print("loadgen: --scale, --workers and --max-new-tokens must be positive", file=sys.stderr)
        return 2
    try:
        if args.worker_index is not None:
            print(json.dumps(asdict(replay_share(args))), flush=True)
            return 0
        summary = run_workers(args)
    except kvd.KvdError as exc:
        print(f"loadgen: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary) if args.json else format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
