"""One worker process of the transformers acceptance test: a tiny random Llama on kvd.

    python hf_run.py --role first  --out a.npz float32=DAEMON float16=DAEMON ...   # process A
    python hf_run.py --role second --out b.npz float32=DAEMON float16=DAEMON ...   # process B

For each pool dtype (one daemon each; one process serves them all, since importing torch and
transformers costs seconds): A generates for P1. B generates for P2 (shares P1's first 3
blocks), then for P1 itself (the cap rule: 3 of its 4 prompt blocks are cached, the last prompt
token must still be computed), then runs the negative control, then a left-padded batch of four
prompts of different lengths, two of them beginning with P1's cached blocks ("batch"), then the
batch's third prompt alone ("row2": its blocks were sealed by the batch, pads left out). Each
run is saved as `<dtype>_<run>_tokens` (every row), `..._logits` (float32) and `..._meta`
(JSON). The test imports `tiny_llama`, `prompts`, `batch_prompts`, `left_padded` and `GENERATE`
from here for its in-process DynamicCache reference.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvd  # noqa: E402
from kvd.integrations.transformers import (  # noqa: E402
    TORCH_DTYPES, KvdCache, generate_with_kvd, model_salt,
)

BLOCK_SIZE = 16
CONFIG = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
GENERATE = dict(max_new_tokens=32, do_sample=False, output_logits=True,
                return_dict_in_generate=True)


def tiny_llama(dtype: str) -> LlamaForCausalLM:
    """4 layers, hidden 256, 4 heads, 2 KV heads (head dim 64); weights from seed 0.

    initializer_range=0.2 (not the default 0.02) makes greedy decoding non-degenerate.
    """
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval().to(TORCH_DTYPES[dtype])


def prompts() -> tuple[list[int], list[int]]:
    """P1: 64 random token ids; P2: P1's first 48 tokens and 16 others."""
    generator = torch.Generator().manual_seed(1)
    p1 = torch.randint(0, CONFIG["vocab_size"], (64,), generator=generator).tolist()
    tail = torch.randint(0, CONFIG["vocab_size"], (16,), generator=generator).tolist()
    return p1, p1[:48] + tail


def batch_prompts() -> list[list[int]]:
    """Four prompts of 37, 70, 53 and 53 tokens; the second and the fourth begin with P1's
    first 48 tokens (the 3 blocks A seals), the others share nothing."""
    generator = torch.Generator().manual_seed(2)
    a = torch.randint(0, CONFIG["vocab_size"], (37,), generator=generator).tolist()
    b = torch.randint(0, CONFIG["vocab_size"], (53,), generator=generator).tolist()
    p1, _ = prompts()
    return [a, p1[:48] + b[:22], b, p1[:48] + a[:5]]


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` padded on the left with token 0, and the attention mask (what a tokenizer gives)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


class EmbeddedTokens:
    """Counts the tokens each forward really runs through the model (its embedding lookups)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.per_forward: list[int] = []
        model.get_input_embeddings().register_forward_pre_hook(self._count)

    def _count(self, module: torch.nn.Module, args: tuple) -> None:
        self.per_forward.append(int(args[0].numel()))


def _result(output, meta: dict) -> dict[str, np.ndarray]:
    logits = torch.stack(output.logits).float().numpy()  # (steps, rows, vocab)
    return {"tokens": output.sequences.numpy(), "logits": logits,
            "meta": np.array(json.dumps(meta))}


def run(model, client, counter: EmbeddedTokens, prompt: list[int] | list[list[int]]
        ) -> dict[str, np.ndarray]:
    """generate_with_kvd on one prompt or, given a list of prompts, on their padded batch."""
    counter.per_forward.clear()
    generation = generate_with_kvd(model, client, prompt, **GENERATE)
    meta = {"num_cached_tokens": generation.num_cached_tokens,
            "num_computed_tokens": generation.num_computed_tokens,
            "prefill_tokens": counter.per_forward[0],
            "block_ids": generation.rows[0].block_ids,
            "rows": [asdict(row) for row in generation.rows]}
    return _result(generation.output, meta)


def run_shifted(model, client, prompt: list[int]) -> dict[str, np.ndarray]:
    """Negative control: P1's cached prefix mapped one block late (its blocks 1, 2, 3 where 0,
    1, 2 belong) — the off-by-one a block-table bug makes.

    Merely permuting the prefix blocks would prove nothing: RoPE is applied before caching and
    attention sums over every visible key regardless of order, so a permuted prefix gives the
    same logits. Only one token is generated, so no wrongly computed block gets a new hash: its
    one full computed block (tokens 48..63) duplicates A's and is freed, not cached.
    """
    pinned = client.lookup(kvd.hash_blocks(prompt, BLOCK_SIZE, salt=model_salt(model)))
    try:
        with KvdCache(client, model, prompt) as cache:
            cache._rows[0].seq.block_ids[:3] = pinned[1:4]
            output = model.generate(torch.tensor([prompt]), cache=cache,
                                    **{**GENERATE, "max_new_tokens": 1})
    finally:
        client.release(pinned)
    return _result(output, {"pinned": pinned})


def serve(role: str, dtype: str, daemon: str) -> dict[str, dict[str, np.ndarray]]:
    model = tiny_llama(dtype)
    counter = EmbeddedTokens(model)
    p1, p2 = prompts()
    with kvd.connect(daemon) as client:
        if role == "first":
            return {"p1": run(model, client, counter, p1)}
        return {"p2": run(model, client, counter, p2), "p1": run(model, client, counter, p1),
                "shifted": run_shifted(model, client, p1),
                "batch": run(model, client, counter, batch_prompts()),
                "row2": run(model, client, counter, batch_prompts()[2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", required=True, choices=["first", "second"])
    parser.add_argument("--out", required=True)
    parser.add_argument("daemons", nargs="+", metavar="DTYPE=DAEMON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    arrays = {}
    for dtype, daemon in (item.split("=", 1) for item in args.daemons):
        for run_name, fields in serve(args.role, dtype, daemon).items():
            arrays.update({f"{dtype}_{run_name}_{key}": value for key, value in fields.items()})
    np.savez(args.out, **arrays)


if __name__ == "__main__":
    main()
