"""Acceptance (issue 31 item 6): a hybrid model — a tiny random Gemma 2, its default layer types
alternating sliding-window and full attention — generating on a KvdCache whose full-attention
layers live in one pool and sliding-window layers in a window pool of the same daemon model.
Tokens equal DynamicCache's (logits within 1e-4) in float32 and bfloat16; a second process
reuses the first one's prefix and computes only the suffix; during decode the window pool holds
at most ceil(W / block_size) + 1 blocks of the sequence."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.integration

from hf_engines import import_torch

torch = import_torch()

from transformers import Gemma2Config, Gemma2ForCausalLM  # noqa: E402

import kvd  # noqa: E402
from kvd.integrations.transformers import generate_with_kvd  # noqa: E402

BLOCK = 8
WINDOW = 24
CONFIG = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
              initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
GENERATE = dict(max_new_tokens=48, do_sample=False, output_logits=True,
                return_dict_in_generate=True)
P1 = [(7 * i + 3) % 1000 for i in range(43)]
P2 = P1[:35] + [(11 * i + 5) % 1000 for i in range(9)]  # 4 blocks in common (32 tokens)
DTYPES = ("float32", "bfloat16")


def tiny_gemma2(dtype: str):
    torch.manual_seed(31)
    model = Gemma2ForCausalLM(Gemma2Config(**CONFIG)).eval()
    return model.to(getattr(torch, dtype))


def _pools(dtype: str) -> list[str]:
    shape = f"layers=2,kv-heads=2,head-dim=16,dtype={dtype},block-size={BLOCK}"
    return ["--pool", f"full-{dtype}:{shape}", "--pool", f"window-{dtype}:{shape},window={WINDOW}",
            "--model", f"gemma-{dtype}:full-{dtype},window-{dtype}"]


@pytest.fixture(scope="module")
def models():
    return {dtype: tiny_gemma2(dtype) for dtype in DTYPES}


@pytest.fixture
def gemma_daemon(daemon_factory):
    return daemon_factory([arg for dtype in DTYPES for arg in _pools(dtype)], memory=4 << 20)


def _reference(model, prompt):
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), **GENERATE)
    return output.sequences[0].tolist(), torch.stack(output.logits).float()


def _generate(model, client, prompt, dtype, held=None):
    """generate_with_kvd, recording after each forward how many blocks the window pool holds."""
    def count(*_):
        pool = client.stats()["pools"][f"window-{dtype}"]
        held.append(pool["owned"] + pool["sealed"])
    hook = model.register_forward_hook(count) if held is not None else None
    try:
        with torch.no_grad():
            result = generate_with_kvd(model, client, prompt, kvd_model=f"gemma-{dtype}",
                                       **GENERATE)
    finally:
        if hook is not None:
            hook.remove()
    return result


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_hybrid_model_matches_dynamic_cache_with_a_bounded_window_pool(models, gemma_daemon,
                                                                         dtype):
    model = models[dtype]
    with gemma_daemon.connect() as client:
        for prompt, num_cached in ((P1, 0), (P2, 32), (P1, 40)):
            held: list[int] = []
            result = _generate(model, client, prompt, dtype, held)
            tokens, logits = _reference(model, prompt)
            assert result.output.sequences[0].tolist() == tokens
            assert torch.allclose(torch.stack(result.output.logits).float(), logits, atol=1e-4)
            assert result.num_cached_tokens == num_cached
            assert result.num_computed_tokens == len(prompt) - num_cached + 47
            # decode: after the prefill forward, the window pool holds the window's blocks
            assert max(held[1:]) <= math.ceil(WINDOW / BLOCK) + 1, held
        pools = client.stats()["pools"]
        assert pools[f"window-{dtype}"]["owned"] == pools[f"full-{dtype}"]["owned"] == 0


WORKER = """
import sys
sys.path.insert(0, {here!r})
import kvd, torch
from test_hf_hybrid import P1, _generate, tiny_gemma2
with kvd.connect({name!r}) as client:
    result = _generate(tiny_gemma2({dtype!r}), client, P1, {dtype!r})
    print(result.num_cached_tokens, result.num_computed_tokens)
"""


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_second_process_reuses_the_prefix_and_computes_only_the_suffix(models, gemma_daemon,
                                                                         worker_env, dtype):
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", WORKER.format(here=here,
                                                              name=gemma_daemon.name,
                                                              dtype=dtype)],
                         env=worker_env, check=True, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["0", str(len(P1) + 47)]
    model = models[dtype]
    with gemma_daemon.connect() as client:
        result = _generate(model, client, P2, dtype)
    tokens, logits = _reference(model, P2)
    assert result.num_cached_tokens == 32
    assert result.num_computed_tokens == len(P2) - 32 + 47
    assert result.output.sequences[0].tolist() == tokens
    assert torch.allclose(torch.stack(result.output.logits).float(), logits, atol=1e-4)
    assert np.isfinite(logits.numpy()).all()
