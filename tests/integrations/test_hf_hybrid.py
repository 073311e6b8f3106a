"""Acceptance (issue 31 item 6): a hybrid model — a tiny random Gemma 2, its default layer types
alternating sliding-window and full attention — generating on a KvdCache whose full-attention
layers live in one pool and sliding-window layers in a window pool of the same daemon model.
Tokens equal DynamicCache's (logits within 1e-4) in float32 and bfloat16; a second process
reuses the first one's prefix and computes only the suffix; during decode the window pool holds
at most ceil(W / block_size) + 1 blocks of the sequence. Issue 30 item 4 on the same model: a
left-padded batch, two of its rows reusing a prefix another process sealed, token-identical to
DynamicCache in float32, float16 and bfloat16, each row within that bound;
num_return_sequences repeats rows, beam search is refused."""

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

from hf_run import left_padded  # noqa: E402
from transformers import Gemma2Config, Gemma2ForCausalLM  # noqa: E402

import kvd  # noqa: E402
from kvd.integrations.transformers import flat_pool, generate_with_kvd, model_salt  # noqa: E402

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
BATCH_DTYPES = ("float32", "float16", "bfloat16")  # (the daemon has pools for each)


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
    return {dtype: tiny_gemma2(dtype) for dtype in BATCH_DTYPES}


@pytest.fixture
def gemma_daemon(daemon_factory):
    return daemon_factory([arg for dtype in BATCH_DTYPES for arg in _pools(dtype)],
                          memory=6 << 20)


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
    for dtype in {dtypes!r}:
        result = _generate(tiny_gemma2(dtype), client, P1, dtype)
        print(result.num_cached_tokens, result.num_computed_tokens)
"""


def _first_process(daemon, worker_env, dtypes) -> list[str]:
    """Process A: P1 on each dtype's model, sealing its blocks; what it printed."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = WORKER.format(here=here, name=daemon.name, dtypes=tuple(dtypes))
    out = subprocess.run([sys.executable, "-c", code], env=worker_env, check=True,
                         capture_output=True, text=True, timeout=300)
    return out.stdout.split()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_second_process_reuses_the_prefix_and_computes_only_the_suffix(models, gemma_daemon,
                                                                         worker_env, dtype):
    assert _first_process(gemma_daemon, worker_env, [dtype]) == ["0", str(len(P1) + 47)]
    model = models[dtype]
    with gemma_daemon.connect() as client:
        result = _generate(model, client, P2, dtype)
    tokens, logits = _reference(model, P2)
    assert result.num_cached_tokens == 32
    assert result.num_computed_tokens == len(P2) - 32 + 47
    assert result.output.sequences[0].tolist() == tokens
    assert torch.allclose(torch.stack(result.output.logits).float(), logits, atol=1e-4)
    assert np.isfinite(logits.numpy()).all()


# Issue 30 item 4 on a hybrid model: rows of 29, 51, 37 and 44 tokens; rows 1 and 3 begin with
# P1's first 40 tokens (5 blocks process A sealed), the others share nothing.
BATCH = [[(13 * i + 1) % 1000 for i in range(29)],
         P1[:40] + [(17 * i + 2) % 1000 for i in range(11)],
         [(19 * i + 4) % 1000 for i in range(37)],
         P1[:40] + [(23 * i + 6) % 1000 for i in range(4)]]


def _assert_close_logits(ours, reference, dtype: str) -> None:
    """Within 1e-4, but for row 3 in half precision: within 2 ulps of its largest logit.

    Row 3's cached K/V come from process A's forward of P1 (no pads), the reference computes
    them with 7 pads: Gemma 2's eager attention rounds a padded row otherwise, so in float16
    DynamicCache's own logits of row 3 alone and row 3 in this batch differ by 0.0078.
    """
    ours, reference = (torch.stack(output.logits).float() for output in (ours, reference))
    np.testing.assert_allclose(ours[:, :3], reference[:, :3], rtol=0, atol=1e-4, err_msg=dtype)
    ulps = 2 * torch.finfo(getattr(torch, dtype)).eps * float(reference[:, 3].abs().max())
    np.testing.assert_allclose(ours[:, 3], reference[:, 3], rtol=0,
                               atol=1e-4 if dtype == "float32" else ulps, err_msg=dtype)


def _poison_released(client, model, pool: str) -> None:
    """NaN in the window-pool blocks of P1's first 16 tokens: rows 1 and 3 hit the 3 blocks
    after them (the window before token 40), and their blocks 0 and 1 are holes. A masked
    column that read one would turn the row's logits NaN (softmax of a NaN score)."""
    hashes = kvd.hash_blocks(P1[:40], BLOCK, salt=model_salt(model))
    block_ids = client.lookup(hashes, pool=pool)
    try:
        assert len(block_ids) == 5
        flat = flat_pool(client, pool)
        for block in block_ids[:2]:
            flat.rows[flat.base(block):flat.base(block) + flat.block_rows] = float("nan")
        del flat  # (a view of the mapping)
    finally:
        client.release(block_ids, pool=pool)


def _watch_batch(model, client, pool):
    """Record per forward its input's width, per row the window-pool blocks its table holds,
    and how many blocks the daemon's window pool holds."""
    widths, held, totals = [], [], []

    def watch(module, args, kwargs, output):
        widths.append(kwargs["input_ids"].shape[-1])
        held.append([sum(block != -1 for block in row.seq.block_ids[pool])
                     for row in kwargs["cache"]._rows])
        stats = client.stats()["pools"][pool]
        totals.append(stats["owned"] + stats["sealed"])
    return widths, held, totals, model.register_forward_hook(watch, with_kwargs=True)


def test_a_padded_batch_reuses_prefixes_per_row_and_matches_dynamic_cache(models, gemma_daemon,
                                                                          worker_env):
    """The batch, in each dtype, after process A sealed P1: a row whose tail is shorter than
    the widest recomputes cached tokens whose window blocks are released (and its pads read
    token 0's, released too): they must stay masked and finite."""
    assert _first_process(gemma_daemon, worker_env, BATCH_DTYPES) == [
        "0", str(len(P1) + 47)] * len(BATCH_DTYPES)
    ids, mask = left_padded(BATCH)
    steps = GENERATE["max_new_tokens"] - 1
    with gemma_daemon.connect() as client:
        for dtype in BATCH_DTYPES:
            model, window_pool = models[dtype], f"window-{dtype}"
            _poison_released(client, model, window_pool)
            widths, held, totals, hook = _watch_batch(model, client, window_pool)
            try:
                with torch.no_grad():
                    result = generate_with_kvd(model, client, BATCH, kvd_model=f"gemma-{dtype}",
                                               **GENERATE)
            finally:
                hook.remove()
            with torch.no_grad():
                reference = model.generate(ids, attention_mask=mask, **GENERATE)
            assert torch.equal(result.output.sequences, reference.sequences), dtype
            _assert_close_logits(result.output, reference, dtype)
            rows = result.rows
            assert [row.num_cached_tokens for row in rows] == [0, 40, 0, 40], dtype
            # Tails of 29, 11, 37 and 4 tokens: the prefill is 37 columns wide (of 51), and
            # each row stores only its tail and what it decodes
            assert widths[0] == 37 and set(widths[1:]) == {1}, (dtype, widths)
            assert [row.num_computed_tokens for row in rows] == [
                29 + steps, 11 + steps, 37 + steps, 4 + steps], dtype
            # decode: each row holds at most the window's blocks of the window pool
            bound = math.ceil(WINDOW / BLOCK) + 1
            assert max(max(each) for each in held[1:]) <= bound, (dtype, held)
            assert max(totals[1:]) <= len(BATCH) * bound, (dtype, totals)
            pools = client.stats()["pools"]
            assert pools[window_pool]["owned"] == pools[f"full-{dtype}"]["owned"] == 0, dtype
            # Row 0 had 22 pads: its own tokens were hashed, so alone it finds its blocks
            alone = _generate(model, client, BATCH[0], dtype)
            assert alone.num_cached_tokens == 24, dtype
            assert alone.output.sequences[0].tolist() == _reference(model, BATCH[0])[0], dtype


def test_num_return_sequences_repeats_rows_and_beam_search_is_refused(models, gemma_daemon):
    model = models["float32"]
    prompts = BATCH[:2]
    ids, mask = left_padded(prompts)
    sampling = {"do_sample": True, "num_return_sequences": 2, "max_new_tokens": 8}
    torch.manual_seed(3)
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=mask, **sampling)
    with gemma_daemon.connect() as client:
        torch.manual_seed(3)
        with torch.no_grad():
            ours = generate_with_kvd(model, client, prompts, kvd_model="gemma-float32",
                                     **sampling)
        assert torch.equal(ours.output, reference)  # rows 2i and 2i + 1 are prompt i's
        assert [row.num_prompt_tokens for row in ours.rows] == [29, 29, 51, 51]
        with pytest.raises(kvd.BadArgsError, match="beam search .*DynamicCache"):
            generate_with_kvd(model, client, prompts, kvd_model="gemma-float32", num_beams=2,
                              max_new_tokens=2)
        pools = client.stats()["pools"]
        assert pools["window-float32"]["owned"] == pools["full-float32"]["owned"] == 0
        assert pools["window-float32"]["sealed"] == pools["full-float32"]["sealed"] == 0
