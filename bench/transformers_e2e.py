"""Bench: Hugging Face transformers on kvd against the same model on its own DynamicCache.

Two measurements, side by side in one run, each against a real daemon:

1. End to end (workers/hf_generate.py). `--workers` processes serve `--requests` requests, each a
   shared system prompt plus a user message of its own, greedy `--new-tokens` tokens; first all on
   DynamicCache (`--no-kvd`), then all on kvd. Reported: prompt tokens, prefill tokens skipped
   (their K/V came from kvd, computed by whichever worker saw the system prompt first), tokens
   computed, and the serving time — the slowest worker's wall time from its first request to
   its last (interpreter start and model build excluded: they are the same in both modes).
2. Decode step (this process): one sequence prefilled, then `--steps` single-token forwards,
   each timed, on a DynamicCache and on a KvdCache, alternating for `--rounds` rounds; the
   median step of each and their ratio — the adapter's per-step overhead (goal <= 1.2x). Run for
   the bench model and for the tiny test model, whose forward is so cheap that the overhead
   shows most.

    python -m bench.transformers_e2e [--workers 2] [--requests 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvd  # noqa: E402
from bench.common import write_json  # noqa: E402
from kvd.demo import running_daemon  # noqa: E402
from kvd.integrations.transformers import KvdCache  # noqa: E402
from workers.hf_generate import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# (layers, kv_heads, head_dim): the bench model (~30 M parameters) and the acceptance test's.
SHAPES = {"bench": (8, 4, 64), "tiny": (4, 2, 64)}


def _daemon_args(shape: tuple[int, int, int], num_blocks: int, dtype: str) -> argparse.Namespace:
    layers, kv_heads, head_dim = shape
    return argparse.Namespace(num_blocks=num_blocks, block_size=16, layers=layers,
                              kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, policy=None)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def serve(args: argparse.Namespace, daemon: str, uses_kvd: bool) -> dict:
    """Run the workers once; their reports added up, serving time = the slowest worker's."""
    layers, kv_heads, head_dim = SHAPES["bench"]
    command = [sys.executable, "-m", "workers.hf_generate", "--name", daemon, "--json",
               "--num-workers", str(args.workers), "--requests", str(args.requests),
               "--system-prompts", str(args.system_prompts),
               "--system-tokens", str(args.system_tokens), "--user-tokens", str(args.user_tokens),
               "--new-tokens", str(args.new_tokens), "--layers", str(layers),
               "--kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--dtype", args.dtype]
    command += [] if uses_kvd else ["--no-kvd"]
    procs = [subprocess.Popen([*command, "--worker-id", str(i)], env=_worker_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for i in range(args.workers)]
    reports = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1])
               for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError("a worker failed (its error is above)")
    total = {key: sum(r[key] for r in reports) for key in
             ("requests", "prompt_tokens", "skipped_prefill_tokens", "computed_tokens")}
    return {**total, "serving_s": max(r["wall_s"] for r in reports)}


def _decode_steps(model, cache, prompt: torch.Tensor, num_steps: int) -> list[float]:
    """Prefill `prompt` (past what the cache holds), then time each single-token forward."""
    out = model(input_ids=prompt[:, cache.get_seq_length():], cache=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    step_s = []
    for _ in range(num_steps):
        started = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        step_s.append(time.perf_counter() - started)
    return step_s


def decode_overhead(args: argparse.Namespace, shape_name: str) -> dict:
    """Median decode step on DynamicCache and on KvdCache, rounds interleaved."""
    shape = SHAPES[shape_name]
    model = build_model(*shape, args.dtype)
    prompt = torch.randint(0, 1000, (1, args.system_tokens + args.user_tokens),
                           generator=torch.Generator().manual_seed(7))
    num_blocks = args.rounds * (-(-(prompt.shape[1] + args.steps) // 16) + 1)
    daemon = f"bench-hf-{secrets.token_hex(4)}"
    dynamic, paged = [], []
    with running_daemon(_daemon_args(shape, num_blocks, args.dtype), daemon), \
            kvd.connect(daemon) as client, torch.inference_mode():
        for _ in range(args.rounds):
            dynamic += _decode_steps(model, DynamicCache(config=model.config), prompt, args.steps)
            # A fresh salt per round: every round prefills the whole prompt, as DynamicCache does.
            with KvdCache(client, model, prompt, salt=secrets.token_bytes(8)) as cache:
                paged += _decode_steps(model, cache, prompt, args.steps)
    dynamic_s, kvd_s = statistics.median(dynamic), statistics.median(paged)
    return {"model": shape_name, "layers_kv_heads_head_dim": shape,
            "context_tokens": prompt.shape[1], "steps": len(dynamic),
            "dynamic_step_us": dynamic_s * 1e6, "kvd_step_us": kvd_s * 1e6,
            "ratio": kvd_s / dynamic_s}


def end_to_end(args: argparse.Namespace) -> dict:
    num_blocks = args.requests * (-(-(args.system_tokens + args.user_tokens
                                      + args.new_tokens) // 16) + 1)
    daemon = f"bench-hf-{secrets.token_hex(4)}"
    with running_daemon(_daemon_args(SHAPES["bench"], num_blocks, args.dtype), daemon):
        baseline = serve(args, daemon, uses_kvd=False)
        with_kvd = serve(args, daemon, uses_kvd=True)
    return {"dynamic": baseline, "kvd": with_kvd,
            "time_saved": 1 - with_kvd["serving_s"] / baseline["serving_s"]}


def report(results: dict) -> None:
    e2e = results["end_to_end"]
    print(f"\nEnd to end: {results['config']['workers']} workers, "
          f"{e2e['kvd']['requests']} requests, model {SHAPES['bench']} (layers, kv heads, "
          f"head dim), {results['config']['dtype']}")
    print(f"{'cache':8} {'prompt tok':>10} {'skipped':>8} {'computed':>9} {'serving s':>10}")
    for name in ("dynamic", "kvd"):
        row = e2e[name]
        print(f"{name:8} {row['prompt_tokens']:10} {row['skipped_prefill_tokens']:8} "
              f"{row['computed_tokens']:9} {row['serving_s']:10.2f}")
    print(f"time saved: {e2e['time_saved']:.1%}")
    print("\nDecode step, median (goal: kvd <= 1.2x DynamicCache)")
    print(f"{'model':6} {'context':>7} {'steps':>5} {'dynamic us':>10} {'kvd us':>8} {'ratio':>6}")
    for row in results["decode"]:
        print(f"{row['model']:6} {row['context_tokens']:7} {row['steps']:5} "
              f"{row['dynamic_step_us']:10.0f} {row['kvd_step_us']:8.0f} {row['ratio']:6.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="directory to write transformers_e2e.json into")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("end to end ...", file=sys.stderr, flush=True)
    config = {key: value for key, value in vars(args).items() if key != "out"}
    results = {"config": config, "end_to_end": end_to_end(args)}
    print("decode steps ...", file=sys.stderr, flush=True)
    results["decode"] = [decode_overhead(args, name) for name in SHAPES]
    report(results)
    if args.out:
        write_json(args.out, "transformers_e2e", results)


if __name__ == "__main__":
    main()
