"""Acceptance: Hugging Face transformers generating on a kvd-backed cache, across processes.

Process A generates for P1 on a KvdCache and seals its blocks; process B reuses A's blocks for
P2 (48 shared tokens) and for P1 itself (the cap rule), runs a negative control, then a
left-padded batch of four prompts of different lengths, two of which begin with A's blocks, and
one of the batch's prompts alone, on the blocks the batch sealed. Both processes are real
(`hf_run.py`), against a real daemon; the reference is the same model on a DynamicCache in this
process (the same padded batch for the batch). Tokens must be equal and logits within 1e-4
(they are bitwise equal here), for float32, float16 and bfloat16 pools.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration

from hf_engines import import_torch

torch = import_torch()

import kvd  # noqa: E402
from kvd.integrations.transformers import KvdCache, generate_with_kvd, model_salt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from hf_run import (  # noqa: E402
    BLOCK_SIZE, CONFIG, GENERATE, batch_prompts, left_padded, prompts, tiny_llama,
)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

ROOT = HERE.parents[1]
LOGITS_ATOL = 1e-4
NUM_BLOCKS = 64


def _pool_options(dtype: str) -> dict[str, object]:
    return {"num_blocks": NUM_BLOCKS, "layers": CONFIG["num_hidden_layers"],
            "kv_heads": CONFIG["num_key_value_heads"],
            "head_dim": CONFIG["hidden_size"] // CONFIG["num_attention_heads"],
            "block_size": BLOCK_SIZE, "dtype": dtype}


def _run_process(role: str, daemons: dict[str, str], out: Path) -> dict:
    """Run hf_run.py as a real process; returns {dtype: {run: {field: value}}}."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, str(HERE / "hf_run.py"), "--role", role, "--out", str(out),
                    *(f"{dtype}={name}" for dtype, name in daemons.items())],
                   env=env, check=True, timeout=300)
    results: dict[str, dict] = {}
    with np.load(out) as arrays:
        for key in arrays.files:
            dtype, run, field = key.split("_", 2)
            value = arrays[key]
            value = json.loads(str(value)) if field == "meta" else value
            results.setdefault(dtype, {}).setdefault(run, {})[field] = value
    return results


def _reference(model, prompt: list[int] | list[list[int]]) -> dict[str, np.ndarray]:
    """The same model on transformers' own DynamicCache (a list of prompts: padded batch)."""
    if isinstance(prompt[0], list):
        ids, mask = left_padded(prompt)
        output = model.generate(ids, attention_mask=mask, **GENERATE)
    else:
        output = model.generate(torch.tensor([prompt]), **GENERATE)
    return {"tokens": output.sequences.numpy(),
            "logits": torch.stack(output.logits).float().numpy()}


def _assert_matches(dtype: str, run: dict, reference: dict) -> None:
    np.testing.assert_array_equal(run["tokens"], reference["tokens"], err_msg=dtype)
    np.testing.assert_allclose(run["logits"], reference["logits"], rtol=0, atol=LOGITS_ATOL,
                               err_msg=dtype)


def test_processes_share_prefix_blocks_and_match_dynamic_cache(daemon_factory, tmp_path,
                                                               monkeypatch):
    """float32, float16 and bfloat16 pools, one daemon each; A and B serve all three."""
    monkeypatch.setenv("KVD_DEBUG", "1")  # the daemons get the check_invariants op
    dtypes = ("float32", "float16", "bfloat16")
    daemons = {dtype: daemon_factory(**_pool_options(dtype)) for dtype in dtypes}
    names = {dtype: daemon.name for dtype, daemon in daemons.items()}
    a = _run_process("first", names, tmp_path / "a.npz")
    b = _run_process("second", names, tmp_path / "b.npz")
    for dtype in dtypes:
        _check_runs(dtype, a[dtype], b[dtype])
        _check_pool_after(dtype, daemons[dtype])


def _check_runs(dtype: str, a: dict, b: dict) -> None:
    p1, p2 = prompts()
    model = tiny_llama(dtype)
    reference = {"p1": _reference(model, p1), "p2": _reference(model, p2)}
    _assert_matches(dtype, a["p1"], reference["p1"])
    assert a["p1"]["meta"]["num_cached_tokens"] == 0, dtype
    assert a["p1"]["meta"]["prefill_tokens"] == 64, dtype
    a_blocks = a["p1"]["meta"]["block_ids"]
    for run in ("p2", "p1"):  # P2 shares 3 blocks; P1 is capped at floor(63 / 16) = 3 blocks
        meta = b[run]["meta"]
        _assert_matches(dtype, b[run], reference[run])
        assert meta["num_cached_tokens"] == 3 * BLOCK_SIZE, (dtype, run)
        assert meta["block_ids"][:3] == a_blocks[:3], f"{dtype} {run}: B must read A's blocks"
        assert meta["prefill_tokens"] == 16, (
            f"{dtype} {run}: B must compute only the 16 uncached prompt tokens")
        assert meta["num_computed_tokens"] == 16 + GENERATE["max_new_tokens"] - 1, (dtype, run)
    # Negative control: the prefix mapped one block late must visibly change the logits.
    shifted_error = np.abs(b["shifted"]["logits"][0] - reference["p1"]["logits"][0]).max()
    assert shifted_error > 100 * LOGITS_ATOL, f"{dtype}: corrupt KV went unnoticed"
    _check_batch(dtype, model, a_blocks, b["batch"], b["row2"])


def _check_batch(dtype: str, model, a_blocks: list[int], batch: dict, row2: dict) -> None:
    """Rows of 37, 70, 53, 53 tokens; rows 1 and 3 begin with A's 3 blocks."""
    prompts_ = batch_prompts()
    _assert_matches(dtype, batch, _reference(model, prompts_))
    rows = batch["meta"]["rows"]
    assert [row["num_cached_tokens"] for row in rows] == [0, 48, 0, 48], dtype
    for index in (1, 3):
        assert rows[index]["block_ids"][:3] == a_blocks[:3], f"{dtype}: row {index}'s prefix"
    # Uncached tails of 37, 22, 53 and 5 tokens: the batch computes the widest, 53 columns of
    # its 70 (a DynamicCache computes all 70), and each row stores only its own tail.
    assert batch["meta"]["prefill_tokens"] == 4 * 53, dtype
    steps = GENERATE["max_new_tokens"] - 1
    assert [row["num_computed_tokens"] for row in rows] == [
        37 + steps, 22 + steps, 53 + steps, 5 + steps], dtype
    # Row 2 had 17 pads in the batch: its own tokens were hashed, so alone it finds its blocks.
    # Their K/V came from a batched forward, whose matrix products round otherwise than those
    # of a forward of one row: in half precision the logits may differ in the last place.
    reference = _reference(model, prompts_[2])
    np.testing.assert_array_equal(row2["tokens"], reference["tokens"], err_msg=dtype)
    ulps = 2 * torch.finfo(getattr(torch, dtype)).eps * np.abs(reference["logits"]).max()
    atol = LOGITS_ATOL if dtype == "float32" else ulps
    np.testing.assert_allclose(row2["logits"], reference["logits"], rtol=0, atol=atol,
                               err_msg=dtype)
    assert row2["meta"]["num_cached_tokens"] == 48, dtype
    assert row2["meta"]["block_ids"][:3] == rows[2]["block_ids"][:3], dtype


def _check_pool_after(dtype: str, daemon) -> None:
    with daemon.connect() as client:
        stats = client.stats()
        sessions = client._call("check_invariants", {})  # raises InternalError if one fails
    assert [pins for _, _, pins in sessions] == [0], f"{dtype}: only this idle session is live"
    assert stats["free"] + stats["owned"] + stats["sealed"] + stats["cached"] == NUM_BLOCKS
    assert stats["owned"] == stats["sealed"] == stats["sequences"] == 0, (
        f"{dtype}: pins remain: {stats}")
    # 95 computed tokens = 5 sealed blocks per 96-token sequence. A: P1's 5 blocks. B's P2 run:
    # 2 new ones (its first 3 are A's). B's P1 run and the control recompute blocks A already
    # sealed: duplicates are freed, not cached. The batch's rows hold 68, 101, 84 and 84
    # computed tokens: 4 + 6 + 5 + 5 full blocks, of which rows 1 and 3 took 3 each from A:
    # 14 new. Row 2 alone recomputes the batch's row 2: duplicates.
    assert stats["cached"] == stats["indexed"] == 7 + 14, f"{dtype}: {stats}"


@pytest.fixture
def float32_pool(daemon_factory):
    daemon = daemon_factory(**_pool_options("float32"))
    with daemon.connect() as client:
        yield client


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_plain_generate_on_a_kvd_cache_then_reuse_in_process(float32_pool):
    model = tiny_llama("float32")
    p1, _ = prompts()
    with KvdCache(float32_pool, model, p1) as cache:  # the form, past_key_values=
        first = model.generate(torch.tensor([p1]), past_key_values=cache, **GENERATE)
    again = generate_with_kvd(model, float32_pool, p1, **GENERATE)
    assert (cache.rows[0].num_cached_tokens, again.num_cached_tokens) == (0, 48)
    assert torch.equal(first.sequences, again.output.sequences)


def test_model_that_does_not_fit_the_pool_is_refused_before_allocating(float32_pool):
    p1, _ = prompts()
    half = tiny_llama("float16")
    with pytest.raises(kvd.BadArgsError, match="dtype torch.float16"):
        KvdCache(float32_pool, half, p1)
    torch.manual_seed(0)
    wider = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "num_key_value_heads": 4})).eval()
    with pytest.raises(kvd.BadArgsError, match="num_kv_heads 4"):
        KvdCache(float32_pool, wider, p1)
    stats = float32_pool.stats()
    assert stats["owned"] == stats["sequences"] == 0


def test_views_do_not_outlive_the_mapping(daemon_factory):
    daemon = daemon_factory(**_pool_options("float32"))
    model = tiny_llama("float32")
    p1, _ = prompts()
    client = daemon.connect()
    cache = KvdCache(client, model, p1)
    with pytest.raises(kvd.InUseError):
        client.close()  # a live cache holds views of the mapping; the session ends anyway
    with pytest.raises(kvd.DisconnectedError):
        cache.close()  # cannot commit without a session, but drops its views first
    client = daemon.connect()
    cache = KvdCache(client, model, p1)
    cache.close()
    client.close()  # closed cache: no view left
    with pytest.raises(kvd.BadArgsError, match="closed"):
        model(torch.tensor([p1[:1]]), cache=cache)


def test_tokens_other_than_the_prompt_are_refused(float32_pool):
    model = tiny_llama("float32")
    p1, p2 = prompts()
    with KvdCache(float32_pool, model, p1) as cache:
        with pytest.raises(kvd.BadArgsError, match="same input_ids"):
            model.generate(torch.tensor([p2]), cache=cache, max_new_tokens=1)


def _assert_pool_idle(client) -> None:
    stats = client.stats()
    assert stats["owned"] == stats["sealed"] == stats["sequences"] == 0, stats


def test_a_padded_batch_by_hand_and_what_it_refuses(float32_pool):
    """The tokenizer's form: left-padded ids and their mask, to KvdCache and generate alike."""
    model = tiny_llama("float32")
    ids, mask = left_padded(batch_prompts())
    with KvdCache(float32_pool, model, ids, attention_mask=mask) as cache:
        ours = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4)
    assert torch.equal(ours, model.generate(ids, attention_mask=mask, max_new_tokens=4))
    with pytest.raises(kvd.BadArgsError, match="padding_side='left'"):
        KvdCache(float32_pool, model, ids, attention_mask=mask.flip(1))
    with KvdCache(float32_pool, model, ids, attention_mask=mask) as cache:
        with pytest.raises(kvd.BadArgsError, match="attention_mask"):
            model.generate(ids, cache=cache, max_new_tokens=1)  # the mask forgotten
        with pytest.raises(kvd.BadArgsError, match="position_ids"):  # positions by column
            model(ids[:, cache.get_seq_length():], attention_mask=mask, cache=cache)
    _assert_pool_idle(float32_pool)


def test_num_return_sequences_repeats_rows_and_beam_search_is_refused(float32_pool):
    model = tiny_llama("float32")
    prompts_ = batch_prompts()[:2]
    ids, mask = left_padded(prompts_)
    sampling = {"do_sample": True, "num_return_sequences": 2, "max_new_tokens": 8}
    torch.manual_seed(3)
    reference = model.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(3)
    ours = generate_with_kvd(model, float32_pool, prompts_, **sampling)
    assert torch.equal(ours.output, reference)  # rows 2i and 2i + 1 are prompt i's
    assert [row.num_prompt_tokens for row in ours.rows] == [37, 37, 70, 70]
    with pytest.raises(kvd.BadArgsError, match="beam search .*DynamicCache"):
        generate_with_kvd(model, float32_pool, prompts_, num_beams=2, max_new_tokens=2)
    with KvdCache(float32_pool, model, ids, attention_mask=mask) as cache:
        with pytest.raises(kvd.BadArgsError, match="num_beams > 1 .*DynamicCache"):
            model.generate(ids, attention_mask=mask, cache=cache, num_beams=2, max_new_tokens=2)
        with pytest.raises(kvd.BadArgsError, match="repeat_interleave"):
            model.generate(ids, attention_mask=mask, cache=cache, **sampling)
    _assert_pool_idle(float32_pool)


def test_one_model_from_two_paths_shares_blocks_a_fine_tune_does_not(float32_pool, tmp_path):
    tiny_llama("float32").save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    from_a = LlamaForCausalLM.from_pretrained(tmp_path / "a")
    from_b = LlamaForCausalLM.from_pretrained(tmp_path / "b")
    tuned = LlamaForCausalLM.from_pretrained(tmp_path / "a")  # the same config, other weights
    with torch.no_grad():
        for param in tuned.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(4)),
                       alpha=1e-3)
    assert from_a.config._name_or_path != from_b.config._name_or_path
    assert model_salt(from_a) == model_salt(from_b) == model_salt(tiny_llama("float32"))
    p1, _ = prompts()
    runs = [generate_with_kvd(model, float32_pool, p1, max_new_tokens=1)
            for model in (from_a, from_b, tuned)]
    assert [run.num_cached_tokens for run in runs] == [0, 48, 0]
    # A weight changed in place (a training step) changes the salt of the same model object.
    salt = model_salt(tuned)
    with torch.no_grad():
        next(tuned.parameters())[0, 0] += 1
    assert model_salt(tuned) != salt


@pytest.fixture
def recorded_calls(monkeypatch):
    """`record(client)` logs each request the client sends: (op, args, error class name)."""
    calls: list[tuple[str, dict, str | None]] = []

    def record(client) -> None:
        send = client._call

        def call(op: str, args: dict):
            try:
                result = send(op, args)
            except kvd.KvdError as exc:
                calls.append((op, args, type(exc).__name__))
                raise
            calls.append((op, args, None))
            return result

        monkeypatch.setattr(client, "_call", call)

    return record, calls


def test_a_pool_full_mid_decode_keeps_every_computed_full_block(daemon_factory, recorded_calls):
    """Rows of 60 and 50 tokens in a pool of 10 blocks: 4 + 4 for the prompts, then row 0 gets
    its 5th at token 64 (column 64), row 1 at token 64 (column 74); row 0's 6th, at column 80,
    is not there. Row 0 computed 80 tokens (5 full blocks), row 1 70 (4 full blocks and 6)."""
    daemon = daemon_factory(**{**_pool_options("float32"), "num_blocks": 10})
    model = tiny_llama("float32")
    p1, p2 = prompts()
    ids, mask = left_padded([p1[:60], p2[-50:]])
    record, calls = recorded_calls
    with daemon.connect() as client:
        record(client)
        with pytest.raises(kvd.NoSpaceError) as raised:
            with KvdCache(client, model, ids, attention_mask=mask) as cache:
                model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=32)
        assert [row.num_sealed_tokens for row in cache.rows] == [80, 64]
        assert [row.num_computed_tokens for row in cache.rows] == [80, 70]
        stats = client.stats()
    assert stats["cached"] == stats["indexed"] == 5 + 4, stats
    assert stats["owned"] == stats["sealed"] == stats["sequences"] == 0, stats
    # Raised once: no NoSpaceError from close() on top of (or chained to) the first.
    chained = raised.value.__context__ or raised.value.__cause__
    assert not isinstance(chained, kvd.NoSpaceError)
    assert raised.value.__notes__ == [
        "KvdCache.close() kept the K/V of 144 of the 150 tokens it computed, in sealed blocks "
        "(cache.rows[i].num_sealed_tokens per row); the 6 in partial blocks are dropped"]
    # close() sent only tokens that fit in blocks already held: 15 (of the failed 16) for row
    # 0, 5 for row 1; it never asked for a block again.
    failed = [index for index, (_, _, error) in enumerate(calls) if error is not None]
    assert [calls[index][0] for index in failed] == ["seq_extend"]
    after = calls[failed[0] + 1:]
    assert [op for op, _, _ in after] == ["seq_extend", "seq_commit", "seq_extend",
                                          "seq_commit", "seq_close", "seq_close", "stats"]
    assert [len(args["tokens"]) // 4 for op, args, _ in after if op == "seq_extend"] == [15, 5]
    assert len(calls[failed[0]][1]["tokens"]) // 4 == 16
    # A batch the pool cannot open (3 x 4 uncached blocks): the rows opened before the one that
    # failed are closed.
    fresh = torch.randint(0, CONFIG["vocab_size"], (3, 60),
                          generator=torch.Generator().manual_seed(9))
    with daemon.connect() as client:
        with pytest.raises(kvd.NoSpaceError):
            KvdCache(client, model, fresh)
        _assert_pool_idle(client)
