"""A Hugging Face transformers worker on kvd: a Llama generating on shared system prompts.

Theory of operation
-------------------
Each request is a system prompt — one of `--system-prompts`, shared by every worker — followed
by a user message of its own, and asks for `--new-tokens` greedy tokens. The worker runs it with
`generate_with_kvd` (kvd/integrations/transformers.py): the prompt's longest cached prefix —
a system prompt any worker already computed — comes from the daemon's shared memory and is not
prefilled again; the new full blocks are sealed for the others. `--no-kvd` runs the very same
requests on transformers' DynamicCache, the baseline the bench compares against.

The model is a Llama with random weights from a fixed seed (nothing is downloaded): every worker
builds the same one, so their blocks are interchangeable, and its shape must match the daemon's
pool (`--layers`, `--kv-heads`, `--head-dim`, `--dtype`; 2 query heads per KV head).

    python -m workers.hf_generate --name DAEMON --worker-id 0 --num-workers 2 --json

prints one JSON line: requests, prompt tokens, prefill tokens skipped, tokens computed, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import TypedDict

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: never reach for a hub

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvd  # noqa: E402
from kvd.integrations.transformers import TORCH_DTYPES, generate_with_kvd  # noqa: E402

VOCAB_SIZE = 1000
MODEL_SEED = 0
PROMPT_SEED = 1


def build_model(layers: int, kv_heads: int, head_dim: int, dtype: str) -> LlamaForCausalLM:
    """A Llama with random weights from a fixed seed; initializer_range=0.2 keeps greedy output
    varied (with the default 0.02 it soon repeats one token)."""
    num_heads = 2 * kv_heads
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=num_heads * head_dim,
                         intermediate_size=4 * num_heads * head_dim, num_hidden_layers=layers,
                         num_attention_heads=num_heads, num_key_value_heads=kv_heads,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(MODEL_SEED)
    return LlamaForCausalLM(config).eval().to(TORCH_DTYPES[dtype])


def request_prompt(args: argparse.Namespace, request_index: int) -> list[int]:
    """Request `request_index`'s tokens: a shared system prompt, then its own user message.

    The system prompt is drawn per request (seeded by its index), not by `index % K`, which
    would give each of K workers its own system prompt and nothing to share across processes.
    """
    system = random.Random(request_index).randrange(args.system_prompts)
    system_ids = torch.randint(0, VOCAB_SIZE, (args.system_tokens,),
                               generator=torch.Generator().manual_seed(PROMPT_SEED + system))
    user_ids = torch.randint(0, VOCAB_SIZE, (args.user_tokens,),
                             generator=torch.Generator().manual_seed(10_000 + request_index))
    return torch.cat([system_ids, user_ids]).tolist()


@dataclass
class WorkerReport:
    worker_id: int
    uses_kvd: bool
    requests: int = 0
    prompt_tokens: int = 0
    skipped_prefill_tokens: int = 0  # prompt tokens whose K/V came from kvd
    computed_tokens: int = 0  # tokens run through the model
    generated_tokens: int = 0
    wall_s: float = 0.0


class _GenerateOptions(TypedDict):
    """`model.generate`'s keywords here: greedy decoding of `max_new_tokens` tokens."""
    max_new_tokens: int
    do_sample: bool


def _generate(model: LlamaForCausalLM, client: kvd.Client | None, prompt: list[int],
              new_tokens: int, report: WorkerReport) -> None:
    options: _GenerateOptions = {"max_new_tokens": new_tokens, "do_sample": False}
    if client is None:
        model.generate(torch.tensor([prompt]), **options)
        computed = len(prompt) + new_tokens - 1
    else:
        generation = generate_with_kvd(model, client, prompt, **options)
        report.skipped_prefill_tokens += generation.num_cached_tokens
        computed = generation.num_computed_tokens
    report.requests += 1
    report.prompt_tokens += len(prompt)
    report.computed_tokens += computed
    report.generated_tokens += new_tokens


def run(args: argparse.Namespace) -> WorkerReport:
    """Serve this worker's share of the requests (worker i takes i, i + N, ...)."""
    torch.set_num_threads(1)  # one process per core: the workers fill the machine
    model = build_model(args.layers, args.kv_heads, args.head_dim, args.dtype)
    report = WorkerReport(args.worker_id, not args.no_kvd)
    client = None if args.no_kvd else kvd.connect(args.name)
    try:
        started = time.perf_counter()
        with torch.inference_mode():
            for index in range(args.worker_id, args.requests, args.num_workers):
                _generate(model, client, request_prompt(args, index), args.new_tokens, report)
        report.wall_s = time.perf_counter() - started
    finally:
        if client is not None:
            client.close()
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="kvd daemon name or socket path (default: $KVD_NAME)")
    parser.add_argument("--worker-id", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8, help="requests over all workers")
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--no-kvd", action="store_true",
                        help="baseline: the same requests on transformers' DynamicCache")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(f"worker {report.worker_id}: {report.requests} requests, {report.prompt_tokens} "
              f"prompt tokens, {report.skipped_prefill_tokens} prefill tokens skipped, "
              f"{report.wall_s:.2f} s")


if __name__ == "__main__":
    main()
