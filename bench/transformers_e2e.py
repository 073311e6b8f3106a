"""Transformers: Hugging Face transformers on kvd against the same model on its own DynamicCache.

Two measurements, side by side in one run, each against a real daemon:

1. End to end (workers/hf_generate.py). `--workers` processes serve `--requests` requests, each a
   shared system prompt plus a user message of its own, greedy `--new-tokens` tokens; first all on
   DynamicCache (`--no-kvd`), then all on kvd. Reported: prompt tokens, prefill tokens skipped
   (their K/V came from kvd, computed by whichever worker saw the system prompt first), tokens
   computed, and the serving time: the slowest worker's wall time from its first request to its
   last (interpreter start and model build excluded: they are the same in both modes).
2. Decode step (this process): one sequence prefilled, then `--steps` single-token forwards,
   each timed, on a DynamicCache and on a KvdCache, alternating for `--rounds` rounds; the
   median step of each and their ratio: the adapter's per-step overhead (goal <= 1.2x). Run for
   the bench model and for the tiny test model, whose forward is so cheap that the overhead
   shows most.

Skipped, with a note, where torch or transformers is not installed.

    python -m bench.transformers_e2e [--quick] [--workers 2] [--requests 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Daemon, child_env, markdown_table, progress, write_json

# (layers, kv_heads, head_dim): the bench model (~30 M parameters) and the acceptance test's.
SHAPES = {"bench": (8, 4, 64), "tiny": (4, 2, 64)}
BLOCK_SIZE = 16
QUICK = {"workers": 1, "requests": 2, "system_prompts": 1, "system_tokens": 64, "user_tokens": 16,
         "new_tokens": 4, "steps": 4, "rounds": 1}


def start_daemon(shape: tuple[int, int, int], num_blocks: int, dtype: str) -> Daemon:
    layers, kv_heads, head_dim = shape
    return Daemon(num_blocks, journal=True, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                  block_size=BLOCK_SIZE, dtype=dtype)


def serve(args: argparse.Namespace, daemon: Daemon, uses_kvd: bool) -> dict[str, Any]:
    """Run the workers once; their reports added up, serving time = the slowest worker's."""
    layers, kv_heads, head_dim = SHAPES["bench"]
    command = [sys.executable, "-m", "workers.hf_generate", "--name", daemon.socket_path,
               "--json", "--num-workers", str(args.workers), "--requests", str(args.requests),
               "--system-prompts", str(args.system_prompts),
               "--system-tokens", str(args.system_tokens), "--user-tokens", str(args.user_tokens),
               "--new-tokens", str(args.new_tokens), "--layers", str(layers),
               "--kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--dtype", args.dtype]
    command += [] if uses_kvd else ["--no-kvd"]
    env = dict(child_env(), HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([*command, "--worker-id", str(i)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for i in range(args.workers)]
    reports = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1])
               for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError("a worker failed (its error is above)")
    total = {key: sum(r[key] for r in reports) for key in
             ("requests", "prompt_tokens", "skipped_prefill_tokens", "computed_tokens")}
    return {**total, "serving_s": max(r["wall_s"] for r in reports)}


def end_to_end(args: argparse.Namespace) -> dict[str, Any]:
    num_blocks = args.requests * (-(-(args.system_tokens + args.user_tokens
                                      + args.new_tokens) // BLOCK_SIZE) + 1)
    with start_daemon(SHAPES["bench"], num_blocks, args.dtype) as daemon:
        baseline = serve(args, daemon, uses_kvd=False)
        with_kvd = serve(args, daemon, uses_kvd=True)
    return {"dynamic": baseline, "kvd": with_kvd,
            "time_saved": 1 - with_kvd["serving_s"] / baseline["serving_s"]}


def _decode_steps(model: Any, cache: Any, prompt: Any, num_steps: int) -> list[float]:
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


def decode_overhead(args: argparse.Namespace, shape_name: str) -> dict[str, Any]:
    """Median decode step on DynamicCache and on KvdCache, rounds interleaved."""
    import torch
    from transformers import DynamicCache

    from kvd.integrations.transformers import KvdCache
    from workers.hf_generate import build_model

    shape = SHAPES[shape_name]
    model = build_model(*shape, args.dtype)
    prompt = torch.randint(0, 1000, (1, args.system_tokens + args.user_tokens),
                           generator=torch.Generator().manual_seed(7))
    num_blocks = args.rounds * (-(-(prompt.shape[1] + args.steps) // BLOCK_SIZE) + 1)
    dynamic: list[float] = []
    paged: list[float] = []
    with start_daemon(shape, num_blocks, args.dtype) as daemon, daemon.connect() as client, \
            torch.inference_mode():
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    progress("transformers: end to end, DynamicCache then kvd")
    config = {key: value for key, value in vars(args).items() if key != "out"}
    results: dict[str, Any] = {"config": config, "end_to_end": end_to_end(args)}
    progress("transformers: decode steps")
    results["decode"] = [decode_overhead(args, name) for name in SHAPES]
    return results


def markdown(results: dict[str, Any]) -> str:
    e2e, config = results["end_to_end"], results["config"]
    serving = markdown_table(
        ["cache", "prompt tokens", "skipped", "computed", "serving s"],
        [[name, row["prompt_tokens"], row["skipped_prefill_tokens"], row["computed_tokens"],
          f"{row['serving_s']:.2f}"] for name, row in ((n, e2e[n]) for n in ("dynamic", "kvd"))])
    decode = markdown_table(
        ["model", "context", "steps", "DynamicCache µs", "kvd µs", "kvd / DynamicCache"],
        [[row["model"], row["context_tokens"], row["steps"], f"{row['dynamic_step_us']:.0f}",
          f"{row['kvd_step_us']:.0f}", f"{row['ratio']:.2f}x"] for row in results["decode"]])
    return ("## Transformers on kvd vs DynamicCache (bench/transformers_e2e.py)\n\n"
            f"End to end: {config['workers']} workers, {e2e['kvd']['requests']} requests, model "
            f"{SHAPES['bench']} (layers, KV heads, head dim), {config['dtype']}; time saved "
            f"**{e2e['time_saved']:.1%}**:\n\n" + serving
            + "\nDecode step, medians (goal: kvd <= 1.2x DynamicCache):\n\n" + decode)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (one short worker)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return parser


def run_bench(quick: bool, out: Path, argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv or [])
    if quick:
        vars(args).update(QUICK)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return (f"## Transformers on kvd vs DynamicCache (bench/transformers_e2e.py)\n\n"
                f"Skipped: {exc.name} is not installed (pip install -e '.[engines]').\n")
    results = run(args)
    write_json(out, "transformers_e2e", results)
    return markdown(results)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    print(run_bench(args.quick, args.out, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
