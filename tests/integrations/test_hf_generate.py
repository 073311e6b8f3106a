"""workers/hf_generate.py against a real daemon: the same requests with and without kvd."""

from __future__ import annotations

import argparse
import os

import pytest

pytestmark = pytest.mark.integration
# CI sets KVD_REQUIRE_ENGINES=1: there a missing engine fails the run instead of skipping it.
if os.environ.get("KVD_REQUIRE_ENGINES") != "1":
    pytest.importorskip("torch", reason="torch is not installed: `pip install -e '.[engines]'`")
    pytest.importorskip("transformers", reason="transformers is not installed: "
                        "`pip install -e '.[engines]'`")

from workers import hf_generate  # noqa: E402

SHAPE = {"layers": 2, "kv_heads": 2, "head_dim": 32, "dtype": "float32", "block_size": 16}


def _args(daemon_name: str, *extra: str) -> list[str]:
    return ["--name", daemon_name, "--requests", "6", "--system-prompts", "2",
            "--system-tokens", "64", "--user-tokens", "8", "--new-tokens", "4",
            "--layers", "2", "--kv-heads", "2", "--head-dim", "32", *extra]


def test_worker_skips_the_prefill_of_system_prompts_it_has_seen(daemon_factory):
    daemon = daemon_factory(num_blocks=64, **SHAPE)
    parser = argparse.ArgumentParser()
    hf_generate.add_arguments(parser)
    baseline = hf_generate.run(parser.parse_args(_args(daemon.name, "--no-kvd")))
    first = hf_generate.run(parser.parse_args(_args(daemon.name)))
    again = hf_generate.run(parser.parse_args(_args(daemon.name)))
    assert baseline.prompt_tokens == first.prompt_tokens == 6 * 72
    assert baseline.skipped_prefill_tokens == 0
    num_systems = len({hf_generate.request_prompt(parser.parse_args(_args(daemon.name)),
                                                  i)[0] for i in range(6)})
    # The first sight of each system prompt is prefilled; every later one reuses its 4 blocks.
    assert first.skipped_prefill_tokens == (6 - num_systems) * 64
    # Second pass: every prompt's full blocks are cached, capped below the prompt's last token.
    assert again.skipped_prefill_tokens == 6 * 64
    assert first.computed_tokens == baseline.computed_tokens - first.skipped_prefill_tokens
    with daemon.connect() as client:
        assert client.stats()["owned"] == 0
