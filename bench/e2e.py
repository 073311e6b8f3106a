"""End to end: the demo's attention workers with kvd's prefix cache vs recomputing every prompt.

The workload is the demo's (workers/attention.py `conversations`): a few system prompts shared by
every worker, multi-turn conversations that re-send their whole history each turn — the shape of
the Mooncake conversation trace (one common system prompt, then per-conversation reuse).

* **kvd**: N `python -m workers.attention` processes against one daemon (`kvd start` with the
  demo's geometry). A prompt's cached prefix — a system prompt any worker computed, or the
  conversation's earlier turns — is read from shared memory, not prefilled again.
* **recompute**: N processes running the same model (same seed, same weights) on the same
  conversations with a private contiguous KV cache per request, prefilling every prompt from
  token 0: what a worker without a shared prefix cache does.

Reported: generated tokens/s over all workers (tokens / the slowest worker's busy seconds), the
prefill tokens each mode computed, kvd's prefix hit ratio, and the largest difference between the
two modes' logits (the cached K/V must give the same model output). A run of either mode is about
a second of work on a VM whose speed drifts within minutes, so the modes take turns, REPEATS pairs
of them (kvd against a fresh daemon each time), and the table is the pair with the median
speedup, with the range over all pairs beside it.

    python -m bench.e2e [--quick] [--workers N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (ROOT, Daemon, GeometryFlags, child_env, markdown_table, progress, pyplot,
                          report, save_plot)

GEOMETRY: GeometryFlags = {"layers": 4, "kv_heads": 2, "head_dim": 32, "block_size": 16,
                           "dtype": "float32"}
FULL_WORKLOAD = {"system_prompts": 3, "system_tokens": 512, "conversations": 3, "turns": 4,
                 "user_tokens": 48, "new_tokens": 32}
QUICK_WORKLOAD = {"system_prompts": 2, "system_tokens": 128, "conversations": 1, "turns": 2,
                  "user_tokens": 16, "new_tokens": 4}
REPEATS = 5  # pairs of runs, the modes taking turns (--quick: 1)


def workload_args(workload: dict[str, int]) -> list[str]:
    return [arg for key, value in workload.items()
            for arg in (f"--{key.replace('_', '-')}", str(value))]


# ---- the recompute worker (a child process) ---------------------------------------------------
def recompute_worker(args: argparse.Namespace) -> dict[str, Any]:
    """workers.attention's conversations, each prompt prefilled from scratch, no shared cache."""
    from kvd.geometry import Geometry
    from workers.attention import (
        RequestStats,
        WorkerStats,
        config_for_geometry,
        conversations,
        run_conversation,
    )
    from workers.model import ContiguousKV, DecoderLM

    geometry = Geometry(num_blocks=1, num_layers=GEOMETRY["layers"],
                        block_size=GEOMETRY["block_size"], num_kv_heads=GEOMETRY["kv_heads"],
                        head_dim=GEOMETRY["head_dim"], dtype=GEOMETRY["dtype"])
    config = config_for_geometry(geometry, args.heads_per_kv, args.vocab_size, args.seed)
    model = DecoderLM(config)
    stats = WorkerStats(args.worker_id)
    all_logits = []

    def generate(prompt: np.ndarray, n: int) -> tuple[list[int], list[np.ndarray]]:
        started = time.perf_counter()
        kv = ContiguousKV(config, len(prompt) + n, GEOMETRY["dtype"])
        logits = model.prefill(prompt, 0, kv)
        prefilled = time.perf_counter()
        tokens, step_logits = model.decode(logits, len(prompt), n, kv)
        stats.add(RequestStats(len(prompt), 0, len(tokens), prefilled - started,
                               time.perf_counter() - prefilled))
        return tokens, step_logits

    for conversation in conversations(
            args.worker_id, args.num_workers, args.conversations, args.turns,
            args.system_prompts, args.system_tokens, args.user_tokens, args.vocab_size, args.seed):
        for step_logits in run_conversation(generate, conversation, args.new_tokens):
            all_logits.append(np.stack(step_logits))
    np.save(args.save_logits, np.stack(all_logits))
    return stats.to_dict()


def recompute_parser() -> argparse.ArgumentParser:
    from workers.attention import add_workload_arguments

    parser = argparse.ArgumentParser(prog="python -m bench.e2e --recompute-worker")
    parser.add_argument("--recompute-worker", action="store_true")
    parser.add_argument("--worker-id", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--save-logits", required=True)
    add_workload_arguments(parser)
    return parser


# ---- driver ------------------------------------------------------------------------------------
def run_workers(commands: list[list[str]]) -> list[dict[str, Any]]:
    """Start every worker at once; each prints one JSON line of WorkerStats."""
    procs = [subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              text=True) for command in commands]
    outputs = [proc.communicate()[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"e2e workers failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def summarize(shares: list[dict[str, Any]]) -> dict[str, Any]:
    total = {key: sum(s[key] for s in shares)
             for key in ("requests", "prompt_tokens", "cached_tokens", "new_tokens")}
    busy_s = max(s["prefill_s"] + s["decode_s"] for s in shares)
    return {**total, "busy_s": busy_s, "tokens_per_s": total["new_tokens"] / busy_s,
            "prefill_tokens_computed": total["prompt_tokens"] - total["cached_tokens"],
            "prefill_s": sum(s["prefill_s"] for s in shares),
            "prefix_hit_ratio": total["cached_tokens"] / total["prompt_tokens"]}


def run_pair(num_workers: int, extra: list[str], scratch: str) -> dict[str, Any]:
    """One run of each mode, kvd first against a fresh daemon; their speedup and logits' gap."""
    logits = {mode: [f"{scratch}/{mode}{i}.npy" for i in range(num_workers)]
              for mode in ("kvd", "recompute")}
    pair: dict[str, Any] = {}
    with Daemon(2048, **GEOMETRY) as daemon:
        pair["kvd"] = summarize(run_workers([
            [sys.executable, "-m", "workers.attention", "--name", daemon.socket_path,
             "--json", "--worker-id", str(i), "--num-workers", str(num_workers),
             "--save-logits", logits["kvd"][i], *extra] for i in range(num_workers)]))
    pair["recompute"] = summarize(run_workers([
        [sys.executable, "-m", "bench.e2e", "--recompute-worker", "--worker-id", str(i),
         "--num-workers", str(num_workers), "--save-logits", logits["recompute"][i], *extra]
        for i in range(num_workers)]))
    pair["max_logit_difference"] = max(float(np.abs(np.load(a) - np.load(b)).max())
                                       for a, b in zip(logits["kvd"], logits["recompute"]))
    pair["speedup"] = pair["kvd"]["tokens_per_s"] / pair["recompute"]["tokens_per_s"]
    return pair


def run(quick: bool, num_workers: int) -> dict[str, Any]:
    workload = QUICK_WORKLOAD if quick else FULL_WORKLOAD
    extra = workload_args(workload)
    num_pairs = 1 if quick else REPEATS
    pairs = []
    with tempfile.TemporaryDirectory(prefix="kvde2e-") as scratch:
        for number in range(num_pairs):
            progress(f"e2e: pair {number + 1} of {num_pairs}: {num_workers} attention workers "
                     "with kvd's prefix cache, then as many recomputing every prompt")
            pairs.append(run_pair(num_workers, extra, scratch))
    speedups = [pair["speedup"] for pair in pairs]
    median = sorted(pairs, key=lambda pair: pair["speedup"])[len(pairs) // 2]
    return {"workers": num_workers, "geometry": GEOMETRY, "workload": workload,
            "kvd": median["kvd"], "recompute": median["recompute"], "speedup": median["speedup"],
            "speedups": speedups,
            "max_logit_difference": max(pair["max_logit_difference"] for pair in pairs)}


def markdown(results: dict[str, Any]) -> str:
    rows = []
    for mode, label in (("kvd", "kvd prefix cache"), ("recompute", "recompute every prompt")):
        r = results[mode]
        rows.append([label, f"{r['tokens_per_s']:.0f}", r["prefill_tokens_computed"],
                     r["prompt_tokens"], f"{r['prefix_hit_ratio']:.1%}", f"{r['prefill_s']:.2f}"])
    table = markdown_table(["mode", "generated tokens/s", "prefill tokens computed",
                            "prompt tokens", "prefix hit ratio", "prefill s (all workers)"], rows)
    w = results["workload"]
    note = (f"{results['workers']} workers; {w['system_prompts']} shared system prompts of "
            f"{w['system_tokens']} tokens, {w['conversations']} conversations per worker of "
            f"{w['turns']} turns ({w['user_tokens']} user tokens, {w['new_tokens']} generated); "
            f"NumPy model with {GEOMETRY['layers']} layers, {GEOMETRY['kv_heads']} KV heads x "
            f"{GEOMETRY['head_dim']}. kvd speedup: **{results['speedup']:.2f}x** tokens/s, the "
            f"median of {len(results['speedups'])} pairs of runs taking turns (the table's; all "
            f"pairs: {min(results['speedups']):.2f}-{max(results['speedups']):.2f}x); largest "
            f"logit difference between the modes {results['max_logit_difference']:.2e}.")
    return "## End to end: attention workers, kvd prefix cache vs recompute (bench/e2e.py)\n\n" \
        + table + "\n" + note + "\n"


def plot(results: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    modes = ["kvd", "recompute"]
    axes[0].bar(modes, [results[m]["tokens_per_s"] for m in modes], color=["C0", "C1"])
    axes[0].set(ylabel="generated tokens/s", title="Throughput")
    axes[1].bar(modes, [results[m]["prefill_tokens_computed"] for m in modes], color=["C0", "C1"])
    axes[1].set(ylabel="prefill tokens computed", title="Prefill work")
    return save_plot(figure, out, "e2e")


def run_bench(quick: bool, out: Path, num_workers: int | None = None) -> str:
    return report(out, "e2e", run(quick, num_workers or (1 if quick else 2)), markdown, plot)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--recompute-worker" in argv:
        print(json.dumps(recompute_worker(recompute_parser().parse_args(argv))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (one short worker)")
    parser.add_argument("--workers", type=int, help="worker processes (default 2, quick 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    print(run_bench(args.quick, args.out, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
